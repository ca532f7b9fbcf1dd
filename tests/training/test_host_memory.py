"""host_memory: with the mmap threshold fixed, a freed large tensor leaves the process's RSS."""
import subprocess
import sys

import pytest

from pagedllm.training import host_memory

CHILD = """
import sys, torch
from pagedllm.training.host_memory import fix_mmap_threshold
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:')) // 1024
assert fix_mmap_threshold(int(sys.argv[1])) == (int(sys.argv[1]) > 0)
# a 16 MiB tensor is mmapped and freed: glibc's dynamic threshold then rises to 16 MiB
a = torch.ones(4 << 20); del a
base = rss()
held, pins = [], []
for _ in range(32):  # 256 MiB, touched; each followed by a small tensor that stays (the heap cannot trim its top)
    held.append(torch.ones(2 << 20))
    pins.append(torch.ones(32 << 10))  # 128 KiB: from the top of the heap, not a free list
del held
print(rss() - base)
"""


def _kept_mib(threshold: int) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(threshold)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_fixed_threshold_returns_freed_tensors_to_the_os():
    assert _kept_mib(0) > 200  # glibc's default: the heap keeps the freed 256 MiB
    assert _kept_mib(1 << 20) < 32  # fixed at 1 MiB: each tensor was its own mapping, unmapped on free


def test_zero_leaves_glibc_alone(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory.threshold_bytes() == 0
    assert host_memory.fix_mmap_threshold() is False
    monkeypatch.setenv(host_memory.ENV, str(4 << 20))
    assert host_memory.threshold_bytes() == 4 << 20
