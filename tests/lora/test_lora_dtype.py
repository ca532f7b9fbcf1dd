"""`lora_dtype` (vLLM's name): adapters' pairs kept in bfloat16 give the deltas of the same pairs
rounded to bfloat16 and kept in float32, in the fused C step (which widens them as it reads:
checked on the native and the AVX2 build) and in the modules; float32 stays PEFT's tokens
(test_mixed_batches.py); a value outside auto/float32/bfloat16 is refused by name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.adapters.peft_format import WEIGHTS_FILE
from pagedllm.entrypoints.llm import LLM
from pagedllm.layers import kernels
from pagedllm.lora.manager import pair_dtype
from pagedllm.lora.request import LoRARequest
from pagedllm.models.fused_decode import FusedDecoder
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")

PROMPTS = [[5, 17, 99, 200, 31, 7, 8, 9, 40, 41, 42, 43, 11], [100, 101, 102, 3, 4, 60, 61, 62, 63, 64]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
NAMES = ("attn", "mlp", "all")  # every projection a pair may sit on (tests/lora_adapters.py)


def rounded_copy(folder: Path, out: Path) -> Path:
    """The adapter at `folder` with A and B rounded to bfloat16 (stored as float32). Its scaling
    (alpha / r) is 2 for every test adapter, a power of two: B * scaling rounds as B does, so this
    folder at lora_dtype="float32" holds exactly the values the original holds at "bfloat16"."""
    shutil.copytree(folder, out)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    save_file({k: v.to(torch.bfloat16).to(torch.float32) for k, v in tensors.items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def rounded(adapters, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rounded-adapters")
    return {name: rounded_copy(adapters[name], root / name) for name in NAMES}


def generate(base: Path, folders: dict[str, Path], **engine_args):
    """Every prompt under every adapter and the base in one batch: (token ids, logprobs) each,
    and how many decode steps with adapter rows the fused C step ran."""
    calls = []
    original = FusedDecoder.__call__

    def counting(self, *args, **kwargs):
        calls.append(len(args) > 4 and args[4] is not None)
        return original(self, *args, **kwargs)

    FusedDecoder.__call__ = counting
    try:
        llm = LLM(str(base), enable_lora=True, max_loras=len(folders), max_lora_rank=8, block_size=4, **engine_args)
        loras = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(folders.items())]
        chosen = [lora for lora in loras for _ in PROMPTS]
        outputs = llm.generate([{"prompt_token_ids": p} for _ in loras for p in PROMPTS], PARAMS, use_tqdm=False,
                               lora_request=chosen)
    finally:
        FusedDecoder.__call__ = original
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], sum(calls)


def max_logprob_difference(a, b) -> float:
    worst = 0.0
    for (tokens, logprobs), (their_tokens, theirs) in zip(a, b):
        assert tokens == their_tokens
        for mine, other in zip(logprobs, theirs):
            worst = max([worst] + [abs(e.logprob - other[t].logprob) for t, e in mine.items() if t in other])
    return worst


@pytest.mark.parametrize("build", [(), kernels.ISA_FLAGS["avx2"]], ids=["native", "avx2"])
def test_bf16_pairs_in_the_fused_step_are_the_fp32_pairs_rounded(lora_base, adapters, rounded, build, monkeypatch):
    """The C step reading bfloat16 pairs against the same values as float32 pairs: the same sums
    in the same order (up to the vectoriser's choices), so logprobs agree to float32 rounding. A
    widening that read the wrong bits, or the pairs as float32, changes every token's logprobs."""
    library = kernels.load(build)
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): library)
    bf16, fused = generate(lora_base, {n: adapters[n] for n in NAMES}, lora_dtype="bfloat16", decode_backend="fused")
    fp32, _ = generate(lora_base, rounded, lora_dtype="float32", decode_backend="fused")
    plain, _ = generate(lora_base, {n: adapters[n] for n in NAMES}, lora_dtype="float32", decode_backend="fused")
    assert fused >= PARAMS.max_tokens - 1, "the adapter rows did not go through the fused step"
    assert max_logprob_difference(bf16, fp32) < 2e-5
    # (the rounding is visible: an unrounded float32 run differs by more than the tolerance above)
    differences = [abs(e.logprob - b[t].logprob) for (_, la), (_, lb) in zip(bf16[2:], plain[2:])
                   for a, b in zip(la, lb) for t, e in a.items() if t in b]
    assert max(differences) > 1e-4


def test_bf16_pairs_through_the_modules_match_the_fused_step(lora_base, adapters):
    """The modules (prefill, and here every decode step too) compute with float32 sites holding
    the pairs' bfloat16 values: the same deltas as the fused step's widened pairs."""
    folders = {n: adapters[n] for n in NAMES}
    fused, calls = generate(lora_base, folders, lora_dtype="bfloat16", decode_backend="fused")
    modules, none = generate(lora_base, folders, lora_dtype="bfloat16", decode_backend="torch")
    assert calls and not none
    assert max_logprob_difference(fused, modules) < 1e-4


def test_pair_dtype_names_and_auto():
    """auto: the model's dtype (vLLM's meaning; bfloat16 pairs were no faster at two threads)."""
    assert pair_dtype("float32", torch.float32) == torch.float32
    assert pair_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert pair_dtype("auto", torch.float32) == torch.bfloat16  # the fused C step's half-size pairs
    assert pair_dtype("auto", torch.float32, "cuda") == torch.float32  # no C step there: the model's
    assert pair_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert pair_dtype("auto", torch.float16) == torch.float16


@pytest.mark.parametrize("value", ["float16", "bf16", 3])
def test_a_bad_lora_dtype_is_refused_by_name(lora_base, value):
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LLM(str(lora_base), enable_lora=True, lora_dtype=value)


def test_a_torch_dtype_is_taken_as_its_name(lora_base):
    llm = LLM(str(lora_base), enable_lora=True, lora_dtype=torch.bfloat16, block_size=4)
    assert llm.llm_engine.runner.lora.pair_dtype == torch.bfloat16


def test_the_server_refuses_a_bad_lora_dtype_at_start(lora_base, capsys):
    from pagedllm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(lora_base), "--enable-lora", "--lora-dtype", "half"])
    assert exited.value.code == 2 and "--lora-dtype" in capsys.readouterr().err
