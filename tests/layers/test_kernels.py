"""Building the CPU kernel library: once per (sources, flags, compiler, CPU), cached in the
user's own cache (or a private temp folder), the instruction set detected at build time, and a
clean fallback with a clear message without a compiler."""
from __future__ import annotations

import logging
import os
import stat
import tempfile

import pytest

from pagedllm import LLM
from pagedllm.layers import kernels

needs_cc = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")


@needs_cc
def test_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    cc = kernels.compiler()
    first = kernels.build(cc)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    assert kernels.build(cc) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert kernels.build(cc, kernels.ISA_FLAGS["avx2"]) != first  # another instruction set, another build
    assert kernels.load() is kernels.load()  # loaded once per process


@needs_cc
def test_the_isa_follows_the_cpu():
    flags = open("/proc/cpuinfo").read()
    expected = "avx512" if " avx512f " in flags else "avx2" if " avx2 " in flags else "generic"
    assert kernels.isa(kernels.load()) == expected
    assert kernels.load().panel_width() == (16 if expected == "avx512" else 8)


@needs_cc
def test_the_isa_environment_variable_builds_the_avx2_code(monkeypatch):
    """PAGEDLLM_KERNEL_ISA=avx2 gives an AVX-512 machine the code an AVX2-only CPU runs (to measure
    that path where no such CPU is at hand); a value it does not know is an error naming it."""
    monkeypatch.setattr(kernels, "_libraries", {})
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.isa(kernels.load()) in ("avx2", "generic") and kernels.load().panel_width() == 8
    monkeypatch.setattr(kernels, "_libraries", {})
    monkeypatch.setenv(kernels.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_ISA='avx3'"):
        kernels.load()


def _fake_cpuinfo(monkeypatch, vendor: str, family: int, model: int) -> None:
    fields = {"vendor_id": vendor, "cpu family": str(family), "model": str(model)}
    monkeypatch.setattr(kernels, "_cpuinfo", lambda field: fields.get(field, ""))


@pytest.mark.parametrize("vendor, family, model, name", [
    ("GenuineIntel", 6, 143, "Intel"),  # Sapphire Rapids
    ("AuthenticAMD", 23, 0x31, "Zen 2"),  # Rome
    ("AuthenticAMD", 25, 0x01, "Zen 3"),  # Milan
    ("AuthenticAMD", 25, 0x21, "Zen 3"),  # Vermeer
    ("AuthenticAMD", 25, 0x11, "Zen 4"),  # Genoa
    ("AuthenticAMD", 25, 0xA0, "Zen 4"),  # Bergamo
    ("AuthenticAMD", 26, 0x02, "Zen 5"),  # Turin
    ("HygonGenuine", 24, 0x01, "HygonGenuine"),
])
def test_the_cpu_family_is_named_from_vendor_family_and_model(monkeypatch, vendor, family, model, name):
    _fake_cpuinfo(monkeypatch, vendor, family, model)
    assert kernels.cpu_family() == name
    assert kernels.cpu_model().endswith(f"(family {family}, model {model}; {name})")


def test_the_prefetch_hints_follow_the_cpu_family(tmp_path, monkeypatch):
    """An Intel CPU's and a Zen 3's builds stream weights with prefetches into L2 4 KB ahead
    (STREAM_HINTS); a Zen 5's keeps the sources' defaults (non-temporal, 1 KB); each hint is its
    own cached build, and the log line names it with the family."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    compiled = []

    def fake_compile(cc, flags, extra_flags, layout, folder, target):
        compiled.append(flags)
        target.write_bytes(b"")

    monkeypatch.setattr(kernels, "_compile", fake_compile)
    builds, hints = [], []
    for cpu in (("GenuineIntel", 6, 143), ("AuthenticAMD", 25, 1), ("AuthenticAMD", 26, 2)):
        _fake_cpuinfo(monkeypatch, *cpu)
        builds.append(kernels.build("gcc"))
        hints.append(kernels.prefetch_hint())
    intel, zen5 = compiled  # the Zen 3's flags are the Intel build's: the same cached library
    assert set(kernels.L2_4KB) <= set(intel)
    assert not any(flag.startswith("-DSTREAM_") for flag in zen5)
    assert builds[0] == builds[1] != builds[2]
    assert hints == ["into L2, 4096 bytes ahead (Intel)", "into L2, 4096 bytes ahead (Zen 3)", "non-temporal, 1024 bytes ahead (Zen 5)"]


def test_the_cpu_vendor_is_read_from_cpuinfo():
    lines = [line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("vendor_id")]
    assert kernels.cpu_vendor() == (lines[0].split(":", 1)[1].strip() if lines else "")


def test_without_a_compiler_the_engine_runs_its_pytorch_path(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    monkeypatch.setattr(kernels, "_libraries", {})
    with caplog.at_level(logging.WARNING, logger="pagedllm.kernels"):
        llm = LLM(str(model_dir("llama")))
    assert "no C compiler found" in caplog.text and "install gcc" in caplog.text
    runner = llm.llm_engine.runner
    assert runner.model.fused is None and not runner.kernel_attention
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="could not be built"):
        LLM(str(model_dir("llama")), decode_backend="fused")


def test_the_cache_is_the_users_own(tmp_path, monkeypatch):
    """PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME (absolute) or ~/.cache; without a home only the
    temp dir's folder of this user, which always comes last."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    temp = (tmp_path / "tmp" / f"pagedllm-{os.getuid()}" / "kernels", True)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels.cache_dirs() == [(tmp_path / "mine" / "kernels", False), temp]
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert kernels.cache_dirs() == [(tmp_path / "home" / ".cache" / "pagedllm" / "kernels", False), temp]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.cache_dirs()[0] == (tmp_path / "xdg" / "pagedllm" / "kernels", False)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "~")  # as expanduser leaves it where no home is known: not a folder under the cwd
    assert kernels.cache_dirs() == [temp]


@needs_cc
def test_an_unwritable_cache_falls_back_to_a_private_temp_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocked / "cache"))  # mkdir fails, even for root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    built = kernels.build(kernels.compiler())
    assert built.parent == tmp_path / "tmp" / f"pagedllm-{os.getuid()}" / "kernels"
    for folder in (built.parent, built.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_temp_folder_another_user_made_is_not_used(tmp_path, monkeypatch):
    """A library in a folder another user can write would be their code in this process."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / f"pagedllm-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, 65534, 65534)
    folder, private = kernels.cache_dirs()[-1]
    with pytest.raises(PermissionError, match="belongs to another user"):
        kernels._prepare(folder, private)


@needs_cc
def test_a_source_that_fails_to_compile_is_reported_and_nothing_is_cached(tmp_path, monkeypatch):
    """The sources compile concurrently: one failing among them still raises with the compiler's
    own message, and no library (nor a half-built one) lands in the cache."""
    real = kernels.compiler()
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *decode_step.c*) echo "decode_step.c: error: broken" >&2; exit 1;; esac\n'
                  f'exec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(kernels.subprocess.CalledProcessError) as failed:
        kernels.build(str(cc))
    assert "decode_step.c: error: broken" in failed.value.stderr
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []
