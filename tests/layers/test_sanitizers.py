"""The sanitizer job of `make test`: the C kernels built with AddressSanitizer and
UndefinedBehaviorSanitizer (gcc's -fsanitize=address,undefined, the ASan runtime preloaded into
a child python), running the kernel tests and the differential fuzz; and proof that the job
catches what it is for — a build with an injected off-by-one (PAGEDLLM_TEST_OFF_BY_ONE: the
decode attention's score buffer one float short) ends with a heap-buffer-overflow report.

Issue 28's crash (8 logit rows written into 1 row's scratch) was such a write: glibc noticed it
only at a later free(), far from the cause. With that bug put back, this job's fuzz ends with
ASan's heap-buffer-overflow report naming decode_step.c's final rmsnorm.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.layers import kernels

ROOT = Path(__file__).resolve().parents[2]
# The kernels' own tests (the small-M matmul's Q8_0/Q4 block panels, with int8 activations too, and
# their ROW_TILE prefill tiles among them), the fused step against the modules (q4: over kept blocks), the
# differential fuzz (its q4 engine included), and the fused step's LoRA sites over bfloat16 and float32 pairs
# (every folded site, the separate down stage included).
SANITIZED_TESTS = ["tests/layers/test_paged_decode.py", "tests/layers/test_prefill_attention.py",
                   "tests/layers/test_small_matmul.py", "tests/layers/test_int8_activations.py", "tests/layers/test_sampler.py",
                   "tests/layers/test_kernel_checks.py", "tests/layers/test_kv_half_pools.py",
                   "tests/models/test_fused_decode.py", "tests/engine/test_differential_fuzz.py",
                   "tests/lora/test_lora_dtype.py::test_bf16_pairs_in_the_fused_step_are_the_fp32_pairs_rounded",
                   "tests/lora/test_mixed_batches.py::test_the_fused_step_folds_every_site_of_a_wide_model"]
FUZZ_EXAMPLES = "12"
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "LeakSanitizer")

pytestmark = [
    pytest.mark.skipif(not kernels.sanitizer_available(), reason="the sanitizer job needs gcc with its ASan runtime"),
    pytest.mark.skipif(kernels.sanitizing(), reason="already inside the sanitizer job"),
]

INJECTED = """
import torch
from pagedllm.layers import kernels
from pagedllm.layers.paged_decode import paged_decode, run_kernel
library = kernels.load(("-DPAGEDLLM_TEST_OFF_BY_ONE=1",))
assert library is not None
kernels.load = lambda extra_flags=(): library
k, v = torch.randn(2, 3, 4, 2, 8, dtype=torch.float32).unbind(0)
q = torch.randn(1, 2, 1, 8)
table, lens = torch.tensor([[0, 1]]), torch.tensor([8])
torch.testing.assert_close(run_kernel(q, k, v, table, lens, 0, 0.3), paged_decode(q, k, v, table, lens, 0, 0.3))
print("no report")
"""


def sanitized(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **kernels.sanitizer_env(), "PAGEDLLM_FUZZ_EXAMPLES": FUZZ_EXAMPLES}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_kernel_tests_and_the_fuzz_pass_under_the_sanitizers():
    # --capture=sys: a report is written to fd 2 just before the abort, which pytest's fd
    # capture would swallow with the process
    done = sanitized(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--capture=sys", *SANITIZED_TESTS], timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and not any(report in output for report in REPORTS), output[-6000:]
    assert " passed" in done.stdout


def test_the_sanitizers_catch_an_injected_off_by_one():
    done = sanitized(["-c", INJECTED], timeout=300)
    assert done.returncode != 0 and "no report" not in done.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in done.stderr, done.stderr[-4000:]
    assert "paged_decode.c" in done.stderr  # the report names the kernel's source line
