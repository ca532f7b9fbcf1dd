"""Building the CPU kernel library: once per (sources, flags, compiler, CPU), cached, the
instruction set detected at build time, and a clean fallback with a clear message without a
compiler."""
from __future__ import annotations

import logging

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
    assert kernels.build(cc, ("-mno-avx512f",)) != first  # another instruction set, another build
    assert kernels.load() is kernels.load()  # loaded once per process


@needs_cc
def test_the_isa_follows_the_cpu():
    flags = open("/proc/cpuinfo").read()
    expected = "avx512" if " avx512f " in flags else "avx2" if " avx2 " in flags else "generic"
    assert kernels.isa(kernels.load()) == expected
    assert kernels.load().panel_width() == (16 if expected == "avx512" else 8)


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
