"""Shared fixtures: tiny model folders per architecture, and a KV-leak check on every test."""
from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (set before any
# kernel module is imported: @triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from parity import make_reference  # noqa: E402
from tiny_models import build_model  # noqa: E402

from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch) -> folder of a tiny random model of that architecture (built once)."""
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = build_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def reference(model_dir):
    """arch -> transformers' greedy tokens and logits on tests/parity.py's PROMPTS."""
    return make_reference(model_dir)


@pytest.fixture(autouse=True)
def kv_blocks_all_free(monkeypatch):
    """After a test whose requests all finished, every KV block of every engine it made is free."""
    engines: list[weakref.ref] = []
    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield
    for ref in engines:
        engine = ref()
        if engine is None or engine.has_unfinished_requests():
            continue
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], f"KV blocks leaked: {stats}"
        engine.block_manager.check_invariants()
        assert not engine.block_manager.tables and not engine.block_manager.cpu_tables


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster on this machine, shared by the cluster tests (jobs and serving replicas);
    at the end no raylet, GCS server or Ray worker of it may be left."""
    from ray_local import LocalRayCluster

    cluster = LocalRayCluster()
    try:
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"Ray processes left behind: {left}"
