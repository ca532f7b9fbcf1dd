"""The planner, the one owner of how a step runs: the backends it settles at start-up, and its
answers to the scheduler (bursts, proposals, lookahead) and to the runner (how to fill a budget).
The engine suites run every path it chooses; these pin the rules themselves."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import pytest

from pagedllm.config import EngineConfig, ModelConfig, SpeculativeConfig
from pagedllm.layers import kernels
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step.planner import Burst, StepKind, StepPlanner, plain_greedy_decode, plain_random_decode

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
    # a step of plain greedy decodes takes its argmax in the fused call: not with adapters or
    # speculation (their steps need the modules' path), nor without the fused step
    assert planner.fused_argmax and planner.max_burst_rows == 16
    assert not spec.fused_argmax and not decide(model_dir, enable_lora=True).fused_argmax
    assert not decide(model_dir, decode_backend="torch").fused_argmax


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
    one = StepPlanner(max_model_len=512, fused_decode=True, fused_argmax=True)
    assert one.burst([Decoding()] * 3, fusing=False) == Burst(1, 1, 0)  # a greedy burst of one step
    warm = SamplingParams(temperature=0.5, min_p=0.1, seed=3)
    assert one.burst([Decoding(params=warm), Decoding()], fusing=False) == Burst(1, 1, 0)  # the call draws too
    chat = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    assert one.burst([Decoding(params=chat), Decoding(params=warm)], fusing=False) == Burst(1, 1, 0)  # filters too
    for sampler_only in (dict(logprobs=0), dict(top_p=0.9, logprobs=0), dict(repetition_penalty=1.1),
                         dict(presence_penalty=0.5), dict(logit_bias={3: 1.0}), dict(min_tokens=4)):
        params = SamplingParams(temperature=0.5, **sampler_only)
        assert one.burst([Decoding(params=params)], fusing=False) is None, sampler_only  # the sampler samples
    assert multi.burst([Decoding(params=warm)], fusing=False) is None  # no draws where the call takes no argmax
    assert one.burst([Decoding()] * 17, fusing=False) is None
    assert one.burst([Decoding(num_tokens=512, num_computed_tokens=511)], fusing=False) is None  # no position left
    assert one.step_kind(1, 0, greedy_burst=True) is StepKind.GREEDY_STEPS and one.step_kind(1, 0) is StepKind.FORWARD
    spec = StepPlanner(fused_decode=True, num_scheduler_steps=2, fused_spec_cycles=True,
                       speculation=SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 3}))
    assert spec.burst([Decoding()], fusing=True) == Burst(8, 4, 3)  # two cycles of k + 1, or one


@needs_kernels
def test_by_default_only_bursts_of_outputs_returned_whole_take_four_steps(model_dir):
    """num_scheduler_steps unset: four greedy steps a call where every request returns its output
    whole (FINAL_ONLY: offline generate), one where any is streamed; asked for, one count for all.
    Only the fused step takes them unasked, and not with adapters or speculation."""
    planner = decide(model_dir)
    assert (planner.num_scheduler_steps, planner.final_only_steps, planner.max_steps) == (1, 4, 4)
    whole = Decoding(params=replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    assert planner.burst([whole] * 3, fusing=False) == Burst(4, 1, 0)
    assert planner.burst([whole, Decoding()], fusing=False) == Burst(1, 1, 0)  # one streamed output: single steps
    assert planner.burst([whole, replace(whole, num_tokens=510, num_computed_tokens=509)], fusing=False) == Burst(2, 1, 0)
    for asked in (1, 8):
        chosen = decide(model_dir, num_scheduler_steps=asked)
        assert (chosen.num_scheduler_steps, chosen.final_only_steps) == (asked, asked)
        # without the fused step, bursts asked for run as passes back to back (device bursts): whole
        # outputs take them too
        device = decide(model_dir, num_scheduler_steps=asked, decode_backend="torch")
        assert (device.num_scheduler_steps, device.final_only_steps) == (asked, asked)
    folder = str(model_dir("llama"))
    for unasked in (dict(enable_lora=True), dict(speculative_config={"model": folder, "num_speculative_tokens": 3}),
                    dict(decode_backend="torch"), dict(attention_backend="sdpa")):
        assert decide(model_dir, **unasked).max_steps == 1, unasked


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
    assert plain_random_decode(Decoding(params=SamplingParams(temperature=0.7, min_tokens=1)))  # the same edge, drawn
    assert not plain_random_decode(Decoding(params=SamplingParams(temperature=0.7, min_tokens=2)))
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
    # EngineConfig refuses 'fused' with 'sdpa' first; the planner names it too, for a config built otherwise
    folder = str(model_dir("llama"))
    config = EngineConfig.from_kwargs(folder, decode_backend="fused")
    config.attention_backend = "sdpa"
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: it attends with the C decode kernel "
                                         r"\(attention_backend auto or kernel\)$"):
        StepPlanner.decide(config, ModelConfig.from_pretrained(folder), 512)
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


# ---- start-up decisions, one input at a time (mutation testing: `decide` and its helpers) -----------
def _pretend_cuda(monkeypatch, triton_reason: str | None = None) -> None:
    """The planner's CUDA decisions on this CPU machine: nothing is allocated on the device at
    start-up, so a config naming `device='cuda'` and a Triton probe that answers are all it reads."""
    from pagedllm.layers import triton_attention

    monkeypatch.setattr(triton_attention, "unavailable_reason", lambda device: triton_reason)


def test_on_a_gpu_triton_attends_and_decode_steps_replay_cuda_graphs(model_dir, monkeypatch):
    _pretend_cuda(monkeypatch)
    gpu = decide(model_dir, device="cuda", dtype="float16", num_scheduler_steps=4, max_num_seqs=24)
    assert (gpu.attention_backend, gpu.fused_decode, gpu.small_matmul_panels, gpu.cuda_graphs) == ("triton", False, False, True)
    assert (gpu.num_scheduler_steps, gpu.max_burst_rows) == (4, 24)  # bursts as passes back to back on the device
    assert not decide(model_dir, device="cuda", dtype="float16", enforce_eager=True).cuda_graphs
    assert not decide(model_dir, device="cuda", dtype="float16", kv_offload=True).cuda_graphs
    assert not decide(model_dir, device="cuda", dtype="float16", attention_backend="sdpa").cuda_graphs
    moe = str(model_dir("mixtral"))
    assert not StepPlanner.decide(EngineConfig.from_kwargs(moe, device="cuda", dtype="float16"),
                                  ModelConfig.from_pretrained(moe), 512).cuda_graphs
    assert decide(model_dir, device="cuda", dtype="float16", async_scheduling=True).async_scheduling


def test_on_a_gpu_without_triton_auto_falls_back_to_sdpa(model_dir, monkeypatch):
    _pretend_cuda(monkeypatch, triton_reason="no triton here")
    planner = decide(model_dir, device="cuda", dtype="float16", num_scheduler_steps=4)
    assert (planner.attention_backend, planner.cuda_graphs, planner.num_scheduler_steps) == ("sdpa", False, 1)
    with pytest.raises(ValueError, match=r"^attention_backend='triton' cannot be used: no triton here$"):
        decide(model_dir, device="cuda", dtype="float16", attention_backend="triton")


@needs_kernels
def test_the_fused_step_packs_panels_and_takes_its_own_rows(model_dir):
    from pagedllm.layers.small_matmul import MAX_ROWS

    fused = decide(model_dir, max_num_seqs=64, num_scheduler_steps=4)
    assert fused.small_matmul_panels and fused.max_burst_seqs == MAX_ROWS and fused.kernel_attention
    modules = decide(model_dir, decode_backend="torch", max_num_seqs=64)
    assert not modules.small_matmul_panels and modules.max_burst_seqs == 64 and modules.max_burst_rows == 0
    assert decide(model_dir, kv_cache_dtype="bfloat16").kernel_attention  # the C kernels attend: accepted


@needs_kernels
def test_multi_step_on_the_device_needs_one_plain_device(model_dir):
    folder = str(model_dir("llama"))
    base = {"num_scheduler_steps": 8, "decode_backend": "torch"}
    assert decide(model_dir, **base).num_scheduler_steps == 8
    # a draft model's fused cycles need the fused step: on the modules path each engine step runs one step
    assert decide(model_dir, **base, speculative_config={"model": folder, "num_speculative_tokens": 2}).num_scheduler_steps == 1


@needs_kernels
def test_async_scheduling_names_every_clash(model_dir, caplog):
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        planner = decide(model_dir, async_scheduling=True, kv_offload=True)
    assert not planner.async_scheduling
    assert planner.notices == ("async_scheduling is off: it does not run with kv_offload",)
    spec = decide(model_dir, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert spec.notices == ("async_scheduling is off: it does not run with the fused C decode step (decode_backend='torch' "
                            "turns it off), speculative_config",)


@needs_kernels
def test_the_draft_models_backends_follow_the_targets(model_dir):
    folder = str(model_dir("llama"))
    draft = {"model": folder, "num_speculative_tokens": 3}
    modules = decide(model_dir, decode_backend="torch", speculative_config=draft)
    assert modules.draft_kernel_attention and modules.draft_fused_decode and not modules.fused_spec_cycles
    assert modules.max_fused_spec_seqs == 0 and modules.draft_model and modules.num_speculative_tokens == 3
    sdpa = decide(model_dir, attention_backend="sdpa", speculative_config=draft)
    assert not (sdpa.draft_kernel_attention or sdpa.draft_fused_decode or sdpa.fused_spec_cycles)
    ngram = decide(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not (ngram.draft_kernel_attention or ngram.draft_fused_decode or ngram.draft_model)
    assert ngram.num_speculative_tokens == 2 and StepPlanner().num_speculative_tokens == 0


def test_fused_decode_refusals_name_every_reason(model_dir):
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: it runs on CPUs in float32; it runs the "
                                         r"whole model over KV pools bound once \(no tensor parallelism, no KV offload\)$"):
        decide(model_dir, decode_backend="fused", dtype="bfloat16", kv_offload=True)
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: it runs the whole model over KV pools "
                                         r"bound once \(no tensor parallelism, no KV offload\)$"):
        decide(model_dir, decode_backend="fused", kv_offload=True)
    moe = ModelConfig.from_pretrained(str(model_dir("mixtral")))
    from pagedllm.step.planner import fused_decode_unsupported

    assert fused_decode_unsupported(moe, torch.float32, torch.device("cpu")) == ["it computes dense MLPs (this is a mixture of experts)"]
    odd = replace(ModelConfig.from_pretrained(str(model_dir("llama"))), head_dim=12)
    assert fused_decode_unsupported(odd, torch.float32, torch.device("cpu")) == [
        "it attends with the C decode kernel (head_dim a multiple of 8)"]


def test_kernels_that_did_not_build(model_dir, monkeypatch):
    """A machine whose C compiler failed: auto attends with SDPA and runs no fused step; asking for
    the kernel or the fused step by name is an error that says the build failed."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    auto = decide(model_dir)
    assert (auto.attention_backend, auto.fused_decode) == ("sdpa", False)
    with pytest.raises(RuntimeError, match=r"^attention_backend='kernel' was asked for, but the kernel could not be built"):
        decide(model_dir, attention_backend="kernel", decode_backend="torch")
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: the CPU kernels could not be built \(see the log\)$"):
        decide(model_dir, decode_backend="fused")


@needs_kernels
def test_a_fused_step_without_kernel_attention_is_an_error(model_dir, monkeypatch):
    from pagedllm.step import planner as planner_module

    monkeypatch.setattr(planner_module, "_attention_backend", lambda *args: "sdpa")
    with pytest.raises(RuntimeError, match=r"^decode_backend='fused' needs the C decode attention kernel, which is not in use$"):
        decide(model_dir, decode_backend="fused")
    assert not decide(model_dir).fused_decode  # auto: quietly not fused


def test_questions_without_speculation_or_bursts():
    plain = StepPlanner()
    assert plain.max_proposals(1) == 0 and plain.max_burst_rows == 0 and plain.max_fused_spec_seqs == 0
    assert not plain.kernel_attention and StepPlanner(attention_backend="kernel").kernel_attention
    assert plain.lookahead_slots(Decoding()) == 0 and not plain.draft_model
    always = StepPlanner(speculation=SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2}))
    assert always.max_proposals(1000) == 2  # no disable_by_batch_size: never paused
    assert always.step_kind(4, 2) is StepKind.GREEDY_STEPS  # proposals, but no fused cycles
    assert not always.fuses_speculation([Decoding()], queued=False)  # no fused cycles: max_fused_spec_seqs is 0
    one = StepPlanner(speculation=SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2}), fused_spec_cycles=True)
    assert one.burst([Decoding()], fusing=True) == Burst(3, 3, 2)  # one cycle of k + 1 per engine step


def test_every_sampling_option_that_is_more_than_an_argmax():
    for params in (SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, frequency_penalty=0.5),
                   SamplingParams(temperature=0, logit_bias={1: 2.0}), SamplingParams(temperature=0, allowed_token_ids=[1, 2])):
        assert not plain_greedy_decode(Decoding(params=params))
    assert not plain_greedy_decode(Decoding(num_computed_tokens=11))  # nothing to compute: not a decode row


def test_one_sequence_and_one_proposal_still_fuse_speculation():
    one = StepPlanner(speculation=SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 1}), fused_spec_cycles=True)
    assert one.max_fused_spec_seqs == 8
    assert one.fuses_speculation([Decoding()], queued=False)  # a single stream: the case fused cycles are for
    assert one.fuses_speculation([Decoding()] * 8, queued=False)


@needs_kernels
def test_the_kernel_probe_is_made_on_the_engines_device(model_dir):
    """The C kernels attend only over CPU caches: on another device (the meta device stands in for
    one here) 'kernel' is refused and 'auto' falls back to SDPA, even where the kernels were built."""
    with pytest.raises(ValueError, match=r"^attention_backend='kernel' needs float32 KV caches on the CPU"):
        decide(model_dir, device="meta", dtype="float32", attention_backend="kernel", decode_backend="torch")
    assert decide(model_dir, device="meta", dtype="float32", decode_backend="torch").attention_backend == "sdpa"


def test_async_scheduling_names_tensor_parallelism(model_dir):
    from pagedllm.step.planner import _async_scheduling

    config = EngineConfig.from_kwargs(str(model_dir("llama")), async_scheduling=True, tensor_parallel_size=2)
    assert _async_scheduling(config, fused=False) == (
        False, ("async_scheduling is off: it does not run with tensor_parallel_size > 1",))


def test_the_fused_step_refused_with_sdpa_or_two_ranks_names_why(model_dir):
    # SDPA rules the fused step out (the config refuses 'fused' with 'sdpa' by name before the planner)
    sdpa = decide(model_dir, attention_backend="sdpa", quantization="q4")
    assert (sdpa.fused_decode, sdpa.small_matmul_panels) == (False, False)
    with pytest.raises(ValueError, match=r"^decode_backend='fused' cannot be used: it runs the whole model over KV pools "
                                         r"bound once \(no tensor parallelism, no KV offload\)$"):
        decide(model_dir, decode_backend="fused", tensor_parallel_size=2)


@needs_kernels
def test_prompt_rows_take_the_fused_step_only_without_int8_activations(model_dir):
    """A short prompt's rows ride a fused step with the exact path's fp32 activations; with int8
    activations they stay off it (a prompt's first-token logprobs would depend on its split)."""
    exact, int8 = decide(model_dir, quantization="q4", int8_activations=False), decide(model_dir, quantization="q4")
    assert exact.fused_decode and int8.fused_decode
    assert exact.prompt_rows_fused is True and exact.decode_rows_fit(4)
    assert int8.prompt_rows_fused is False and not int8.decode_rows_fit(4)


def test_the_planner_keeps_what_the_runner_asks_it(model_dir):
    planner = decide(model_dir, tensor_parallel_size=2, decode_backend="torch")
    assert (planner.max_model_len, planner.tensor_parallel_size, planner.kv_offload) == (512, 2, False)
    assert decide(model_dir, kv_offload=True, decode_backend="torch").kv_offload is True


@needs_kernels
def test_two_scheduler_steps_need_a_backend_and_the_fused_step_is_one(model_dir, caplog):
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        assert decide(model_dir, num_scheduler_steps=2, attention_backend="sdpa").num_scheduler_steps == 1
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("num_scheduler_steps=2 needs")
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedllm.engine"):
        fused = decide(model_dir, num_scheduler_steps=2)
    assert fused.fused_decode and fused.num_scheduler_steps == 2 and caplog.messages == []


@needs_kernels
def test_block_quantized_weights_live_in_panels_off_the_fused_step_too(model_dir, monkeypatch):
    """Where the fused step could run but attention is Triton's (here under its interpreter), a q4 or
    GGUF model keeps its blocks only as panels; a float model keeps its own weights."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    folder = str(model_dir("llama"))
    for quantization, panels in (("q4", True), ("gguf", True), (None, False), ("int8", False)):
        config = EngineConfig.from_kwargs(folder, attention_backend="triton")
        config.quantization = quantization  # 'gguf' is set by a GGUF path; the planner reads only the name
        planner = StepPlanner.decide(config, ModelConfig.from_pretrained(folder), 512)
        assert (planner.attention_backend, planner.fused_decode, planner.small_matmul_panels) == ("triton", False, panels)
