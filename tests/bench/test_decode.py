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
