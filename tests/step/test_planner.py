"""The planner, the one owner of how a step runs: the backends it settles at start-up, and its
answers to the scheduler (bursts, proposals, lookahead) and to the runner (how to fill a budget).
The engine suites run every path it chooses; these pin the rules themselves."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagedllm.config import EngineConfig, ModelConfig, SpeculativeConfig
from pagedllm.layers import kernels
from pagedllm.sampling_params import SamplingParams
from pagedllm.step.planner import Burst, StepKind, StepPlanner, plain_greedy_decode

needs_kernels = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no C kernels")
GREEDY = SamplingParams(temperature=0, max_tokens=100)


@dataclass
class Decoding:
    """What the planner reads of a sequence."""

    params: SamplingParams = field(default_factory=lambda: GREEDY)
    num_tokens: int = 11
    num_computed_tokens: int = 10
    num_output_tokens: int = 1
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: object = None


def decide(model_dir, **engine_args) -> StepPlanner:
    folder = str(model_dir("llama"))
    return StepPlanner.decide(EngineConfig.from_kwargs(folder, **engine_args), ModelConfig.from_pretrained(folder), 512)


@needs_kernels
def test_start_up_decisions_on_a_cpu(model_dir):
    planner = decide(model_dir)
    assert (planner.attention_backend, planner.fused_decode, planner.cuda_graphs) == ("kernel", True, False)
    assert not decide(model_dir, decode_backend="torch").fused_decode
    assert decide(model_dir, attention_backend="sdpa").fused_decode is False
    assert decide(model_dir, num_scheduler_steps=8).max_burst_rows == 16
    # without the fused step, bursts run as passes back to back (up to every running sequence);
    # SDPA's masks are built on the host each step, so it takes single steps
    device = decide(model_dir, num_scheduler_steps=8, decode_backend="torch", max_num_seqs=32)
    assert (device.num_scheduler_steps, device.max_burst_rows) == (8, 32)
    assert decide(model_dir, num_scheduler_steps=8, attention_backend="sdpa").num_scheduler_steps == 1
    assert decide(model_dir, num_scheduler_steps=8, decode_backend="torch", kv_offload=True).num_scheduler_steps == 1
    folder = str(model_dir("llama"))
    spec = decide(model_dir, speculative_config={"model": folder, "num_speculative_tokens": 3})
    assert spec.draft_kernel_attention and spec.draft_fused_decode and spec.fused_spec_cycles and spec.max_fused_spec_seqs == 4
    off = decide(model_dir, speculative_config={"model": folder, "num_speculative_tokens": 3, "fused_cycles": False})
    assert off.draft_fused_decode and not off.fused_spec_cycles


def test_what_is_a_plain_greedy_decode():
    assert plain_greedy_decode(Decoding())
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, min_tokens=5)):
        assert not plain_greedy_decode(Decoding(params=params))
    assert not plain_greedy_decode(Decoding(num_computed_tokens=5))  # a prompt chunk
    assert not plain_greedy_decode(Decoding(grammar=object()))


def test_bursts_and_their_budgets():
    multi = StepPlanner(max_model_len=512, fused_decode=True, num_scheduler_steps=8)
    assert multi.burst([Decoding()] * 3, fusing=False) == Burst(8, 1, 0)
    assert multi.burst([Decoding(), Decoding(num_tokens=508, num_computed_tokens=507)], fusing=False) == Burst(4, 1, 0)  # 4 positions left
    assert multi.burst([Decoding(), Decoding(spec_token_ids=[3])], fusing=False) is None
    assert multi.burst([Decoding()] * 17, fusing=False) is None  # more rows than one fused call takes
    assert StepPlanner(fused_decode=True).burst([Decoding()], fusing=False) is None  # one step per engine step
    spec = StepPlanner(fused_decode=True, num_scheduler_steps=2, fused_spec_cycles=True,
                       speculation=SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 3}))
    assert spec.burst([Decoding()], fusing=True) == Burst(8, 4, 3)  # two cycles of k + 1, or one


def test_speculation_questions():
    spec = StepPlanner(speculation=SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3, "disable_by_batch_size": 4}),
                       fused_spec_cycles=True)
    assert [spec.max_proposals(n) for n in (1, 3, 4)] == [3, 3, 0]
    assert spec.lookahead_slots(Decoding()) == 3 and spec.lookahead_slots(Decoding(num_computed_tokens=2)) == 0
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2, 3]), budget=3, fusing=False) == 2
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2, 3]), budget=9, fusing=True) == 0
    assert spec.fuses_speculation([Decoding()] * 3, queued=False)
    assert not spec.fuses_speculation([Decoding()] * 3, queued=True)
    assert not spec.fuses_speculation([Decoding()] * 4, queued=False)  # paused: the batch is large
    assert not spec.fuses_speculation([Decoding(), Decoding(params=SamplingParams(temperature=0.5))], queued=False)
    ngram = StepPlanner(speculation=SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}))
    assert ngram.lookahead_slots(Decoding()) == 0 and not ngram.draft_model


def test_how_the_runner_fills_a_budget():
    planner = StepPlanner(fused_decode=True, fused_spec_cycles=True)
    assert planner.step_kind(1, 3) is StepKind.FORWARD
    assert planner.step_kind(8, 0) is StepKind.GREEDY_STEPS
    assert planner.step_kind(8, 3) is StepKind.SPEC_CYCLES
    assert planner.decode_rows_fit(16) and not planner.decode_rows_fit(17)
    assert not StepPlanner().decode_rows_fit(1)


# ---- cases found by mutation testing (issue 45, `make mutate`) --------------------------------------
def test_edges_of_the_greedy_rule_and_of_tokens_left():
    from pagedllm.step.planner import tokens_left

    assert plain_greedy_decode(Decoding(params=SamplingParams(temperature=0, logprobs=0)))
    assert not plain_greedy_decode(Decoding(params=SamplingParams(temperature=0, logprobs=1)))
    assert plain_greedy_decode(Decoding(params=SamplingParams(temperature=0, min_tokens=1)))  # 1 output token: met
    assert tokens_left(Decoding(params=SamplingParams(max_tokens=5), num_tokens=11, num_output_tokens=2), 100) == 3
    assert tokens_left(Decoding(params=SamplingParams(max_tokens=50), num_tokens=90, num_output_tokens=2), 100) == 10
    assert tokens_left(Decoding(params=SamplingParams(max_tokens=None), num_tokens=90, num_output_tokens=2), 100) == 10


def test_what_async_scheduling_may_overlap():
    planner = StepPlanner(async_scheduling=True)
    assert planner.overlappable(Decoding())
    assert not planner.overlappable(Decoding(grammar=object()))
    assert not planner.overlappable(Decoding(spec_token_ids=[1]))
    assert not planner.overlappable(Decoding(params=SamplingParams(temperature=0, prompt_logprobs=1)))


def test_edges_of_bursts_verification_and_fusing():
    two = StepPlanner(max_model_len=512, num_scheduler_steps=2, max_burst_seqs=2)
    assert two.burst([Decoding()] * 2, fusing=False) == Burst(2, 1, 0)  # exactly the rows it takes
    assert two.burst([Decoding()] * 3, fusing=False) is None
    assert two.burst([Decoding(num_tokens=511, num_computed_tokens=510)], fusing=False) is None  # one position left
    assert two.burst([], fusing=False) is None
    assert two.step_kind(2, 0) is StepKind.GREEDY_STEPS
    spec = StepPlanner(speculation=SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3}), fused_spec_cycles=True)
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2]), budget=1, fusing=False) == 0
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2]), budget=9, fusing=False) == 2
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2], grammar=object()), budget=9, fusing=False) == 0
    assert spec.num_to_verify(Decoding(spec_token_ids=[1, 2], num_computed_tokens=5), budget=9, fusing=False) == 0
    assert not spec.fuses_speculation([], queued=False)
    rows = spec.max_fused_spec_seqs
    assert spec.fuses_speculation([Decoding()] * rows, queued=False) and not spec.fuses_speculation([Decoding()] * (rows + 1), queued=False)


def test_runs_fused_asks_the_decoder():
    class Decoder:
        def __init__(self, answer):
            self.answer, self.asked = answer, []

        def accepts(self, meta, num_rows):
            self.asked.append((meta, num_rows))
            return self.answer

    planner = StepPlanner()
    yes, no = Decoder(True), Decoder(False)
    assert planner.runs_fused(yes, "meta", 3) and yes.asked == [("meta", 3)]
    assert not planner.runs_fused(no, "meta", 3) and not planner.runs_fused(None, "meta", 3)


def test_configurations_that_cannot_run_are_refused_naming_why(model_dir):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='bfloat16' needs the C attention kernels \(CPU, a float32 model\); "
                                         r"this engine attends with 'sdpa'$"):
        decide(model_dir, kv_cache_dtype="bfloat16", attention_backend="sdpa")
    assert decide(model_dir, num_scheduler_steps=1, attention_backend="sdpa").num_scheduler_steps == 1
    assert decide(model_dir, attention_backend="sdpa").notices == ()


def test_a_draft_attention_window_cuts_every_layer(model_dir):
    from pagedllm.step.planner import draft_model_config

    llama, mistral = str(model_dir("llama")), str(model_dir("mistral"))  # windows: none / 48 on every layer
    assert draft_model_config(llama, None) == ModelConfig.from_pretrained(llama)
    cut = draft_model_config(llama, 16)
    assert set(cut.sliding_windows) == {16} and cut.num_layers == ModelConfig.from_pretrained(llama).num_layers
    assert set(draft_model_config(mistral, 16).sliding_windows) == {16}
    assert set(draft_model_config(mistral, 64).sliding_windows) == {48}  # a wider cut keeps the layer's own window


def test_multi_step_without_a_backend_for_it_runs_single_steps_and_says_why(model_dir, caplog):
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        planner = decide(model_dir, num_scheduler_steps=4, attention_backend="sdpa")
    assert planner.num_scheduler_steps == 1 and not planner.cuda_graphs
    assert caplog.messages == ["num_scheduler_steps=4 needs the fused decode step (CPU) or the C/Triton attention kernels "
                               "on one device without offload or speculation: every engine step runs one step"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        assert decide(model_dir, num_scheduler_steps=1, attention_backend="sdpa").num_scheduler_steps == 1
    assert caplog.messages == []


def test_fused_decode_asked_for_where_it_cannot_run_is_refused_naming_why(model_dir):
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: it runs on CPUs in float32$"):
        decide(model_dir, decode_backend="fused", dtype="bfloat16")
    assert not decide(model_dir, decode_backend="torch").fused_decode


@needs_kernels
def test_async_scheduling_is_off_with_the_fused_step_and_says_why(model_dir, caplog):
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        fused = decide(model_dir, async_scheduling=True)
    notice = "async_scheduling is off: it does not run with the fused C decode step (decode_backend='torch' turns it off)"
    assert fused.fused_decode and not fused.async_scheduling and fused.notices == (notice,) and caplog.messages == [notice]
    modules = decide(model_dir, async_scheduling=True, decode_backend="torch")
    assert modules.async_scheduling and modules.notices == ()
    assert not decide(model_dir, decode_backend="torch").async_scheduling


def test_attention_backends_chosen_and_refused_naming_why(model_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^attention_backend='triton' cannot be used: Triton kernels need a CUDA device "
                                         r"\(TRITON_INTERPRET=1 runs them on the CPU, slowly, for testing\)$"):
        decide(model_dir, attention_backend="triton")
    with pytest.raises(ValueError, match=r"^attention_backend='kernel' needs float32 KV caches on the CPU and a head_dim that "
                                         r"is a multiple of 8; use 'sdpa' or 'auto'$"):
        decide(model_dir, attention_backend="kernel", dtype="bfloat16")
    assert decide(model_dir, attention_backend="auto", dtype="bfloat16").attention_backend == "sdpa"
    assert decide(model_dir, attention_backend="sdpa").attention_backend == "sdpa"
    if kernels.load() is not None:
        assert decide(model_dir, attention_backend="auto").attention_backend == "kernel"
        assert decide(model_dir, attention_backend="kernel", decode_backend="torch").attention_backend == "kernel"
