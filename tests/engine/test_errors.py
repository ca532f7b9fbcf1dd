"""Bad input: a precise exception, nothing queued or leaked, and the engine keeps serving."""
from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.config import ModelLoadError

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir("llama")), max_model_len=64, num_kv_blocks=8, block_size=4)


@pytest.mark.parametrize(
    "prompt, message",
    [
        (list(range(3, 70)), "max_model_len is 64"),
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([5, 384], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
        ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"),
        ([1.5, 2], "list of integers"),
    ],
)
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], GOOD, use_tqdm=False)
    assert llm.get_stats()["num_free_blocks"] == 8 and not llm.llm_engine.requests
    assert len(llm.generate([[5, 6, 7]], GOOD, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_prompt_larger_than_the_kv_pool(model_dir):
    llm = LLM(str(model_dir("llama")), num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        llm.generate([list(range(3, 20))], GOOD, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=-1), "logprobs"),
        (dict(temperature=float("nan")), "temperature"),
        # issue 28: float32 overflows and underflows that made every sampled token 0
        (dict(temperature=1e308), "temperature must be <= 100"),
        (dict(repetition_penalty=1e308), "repetition_penalty must be in"),
        (dict(repetition_penalty=1e-300), "repetition_penalty must be in"),
        (dict(top_p=1e-300), "top_p must be in"),
    ],
)
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [(dict(n=3), "n=3 exceeds max_num_seqs=2"),
                                             (dict(n=1, best_of=3), "best_of=3 exceeds max_num_seqs=2")])
def test_more_samples_than_max_num_seqs_are_refused(model_dir, kwargs, message):
    """Issue 45: a request whose samples cannot all run at once was admitted when nothing else ran."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), max_num_seqs=2)
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=2, **kwargs))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2, n=2))  # exactly the cap runs
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs[0].outputs) == 2


def test_too_many_logprobs(llm):
    with pytest.raises(ValueError, match="logprobs=21 exceeds"):
        llm.generate([[5, 6]], SamplingParams(logprobs=21), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(preemption_policy="random"), "preemption_policy"),
        (dict(watermark=1.0), "watermark"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False), "long_prefill_token_threshold"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(no_such_arg=1), "no_such_arg"),
        (dict(max_model_len=100_000), "max_position_embeddings"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "max_num_batched_tokens"),
        (dict(kv_cache_memory=10), "kv_cache_memory"),
    ],
)
def test_invalid_engine_args(model_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(model_dir("llama")), **kwargs)


def test_unknown_architecture(model_dir, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unknown architecture.*GPT2LMHeadModel"):
        LLM(str(folder))


def test_missing_and_corrupt_model_folders(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(empty))
    bad_json = tmp_path / "bad-json"
    shutil.copytree(model_dir("llama"), bad_json)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(str(bad_json))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(model_dir("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(no_weights))
    truncated = tmp_path / "truncated"
    shutil.copytree(model_dir("llama"), truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot read"):
        LLM(str(truncated))


def test_abort(model_dir):
    engine = LLMEngine.from_engine_args(str(model_dir("llama")))
    engine.abort_request("never-added")  # no-op
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [5, 6, 7, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2], GOOD)
    engine.step()
    engine.abort_request("a")
    assert engine.get_stats()["num_running"] == 1
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a"].outputs[0].finish_reason == "abort"
    assert finals["b"].outputs[0].finish_reason == "length"
    engine.abort_request("b")  # finished already: no-op
