"""bench decode's comparison with its anchor: each round's ratio, not only the best against the best."""
from __future__ import annotations

from pagedllm.bench.decode import Run, _print_ratios, paired_ratios


def test_ratios_pair_each_round_with_the_anchors_run_of_that_round():
    ours = [Run(200.0, 30e9), Run(250.0, 31e9), Run(240.0, 30e9)]
    theirs = [Run(100.0, 30e9), Run(125.0, 31e9), Run(160.0, 30e9)]
    assert paired_ratios(ours, theirs) == [2.0, 2.0, 1.5]


def test_the_report_names_each_engine_batch_and_round_against_the_anchor(capsys):
    results = [("pagedllm", {1: [Run(200.0, 1.0), Run(250.0, 1.0)], 8: [Run(400.0, 1.0)]}),
               ("llama.cpp", {1: [Run(100.0, 1.0), Run(160.0, 1.0)]})]
    _print_ratios(results, "llama.cpp")
    out = capsys.readouterr().out.splitlines()
    # batch 8 has no anchor run: no line for it; best to best is 250 / 160, the median of the rounds (2.00, 1.56)
    assert out == ["pagedllm against llama.cpp, batch 1: 2.00x, 1.56x per round (median 1.78x); best to best 1.56x"]


def test_sampling_flags_reach_every_engine_as_its_own_arguments():
    """--temperature and the filters become pagedllm's SamplingParams, llama-cpp-python's
    generate() arguments and transformers' (whose top-k default, 50, and llama.cpp's, 40, are
    switched off where ours is off); greedy stays as it was; a filter without a temperature is
    refused rather than ignored."""
    import argparse

    import pytest

    from pagedllm.bench.decode import Sampling, _LlamaCpp, add_arguments, sampling_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    greedy = sampling_of(parser.parse_args([]))
    assert greedy == Sampling() and str(greedy) == "greedy"
    assert greedy.params(16, 0).temperature == 0 and greedy.llama_cpp() == {"temp": 0.0, "top_k": 1}
    assert greedy.transformers() == {"do_sample": False}
    chat = sampling_of(parser.parse_args("--temperature 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --seed 3".split()))
    params = chat.params(16, 3)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (0.8, 40, 0.95, 0.05, 3)
    assert params.max_tokens == 16 and params.ignore_eos
    assert chat.llama_cpp() == {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert chat.transformers() == {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert str(chat) == "sampled (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)"
    plain = Sampling(temperature=1.0)
    assert plain.llama_cpp() == {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert plain.transformers() == {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None}
    with pytest.raises(SystemExit, match="give --temperature too"):
        sampling_of(parser.parse_args(["--top-p", "0.9"]))
    # llama.cpp's batch loop is greedy: a sampled batch is not run (no row), a single stream is
    assert _LlamaCpp(None, parser.parse_args([]), 1000, chat)(8) is None
