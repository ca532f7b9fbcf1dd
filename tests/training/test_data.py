"""Corpus reading, the token cache, packing, and the deterministic disjoint split across data-parallel ranks."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.training.config import DataConfig
from pagedllm.training.corpus import iter_documents, source_files
from pagedllm.training.data import BatchPlan, TrainingData, build_cache, cache_key
from pagedllm.training.tokenizer import special_token_ids


def data_config(paths, **extra) -> DataConfig:
    return DataConfig(dataset_path=str(paths["corpus"]), tokenizer_path=str(paths["tokenizer"]), sequence_length=16,
                      global_batch_size=8, micro_batch_size=2, cache_dir=str(paths["cache"]), **extra)


def test_folder_jsonl_and_single_file_documents(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n\n" + json.dumps({"text": "gamma"}) + "\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "c.txt").write_text("skipped")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00binary")
    docs = list(iter_documents(str(tmp_path)))
    assert [(d.doc_id, d.text) for d in docs] == [("a.txt", "alpha"), ("sub/b.jsonl:0", "beta"), ("sub/b.jsonl:2", "gamma")]
    assert [d.text for d in iter_documents(str(tmp_path / "a.txt"))] == ["alpha"]
    (tmp_path / "bad.jsonl").write_text('{"no_text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 1"):
        list(iter_documents(str(tmp_path)))


def test_stdlib_alias_reads_python_sources_only():
    files = source_files("@stdlib", "**/*.py")
    assert any(f.name == "textwrap.py" for f in files)
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)


def test_tokenizing_says_what_it_does(tiny_paths, capsys):
    """The one slow, silent part of a first run (issue 44): a line before, a line after with the counts."""
    cfg = data_config(tiny_paths, validation_split=0.37)  # a key no other test builds
    folder = build_cache(cfg, tiny_paths["cache"])
    err = capsys.readouterr().err
    meta = json.loads((folder / "meta.json").read_text())
    assert f"tokenizing {meta['documents']:,} documents" in err and str(folder) in err
    assert f"tokenized: {meta['tokens']['train']:,} training and {meta['tokens']['val']:,} validation tokens" in err
    build_cache(cfg, tiny_paths["cache"])
    assert "tokeniz" not in capsys.readouterr().err  # reused: nothing to say


def test_tokenizing_off_a_terminal_logs_counts_as_it_goes(tiny_paths, capsys, monkeypatch):
    """In a job's train.log (no terminal, no bar) the counts come as lines while it tokenizes."""
    from pagedllm.training import data

    monkeypatch.setattr(data, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(data, "ENCODE_BATCH", 1)
    cfg = data_config(tiny_paths, validation_split=0.31)  # a key no other test builds
    folder = build_cache(cfg, tiny_paths["cache"])
    documents = json.loads((folder / "meta.json").read_text())["documents"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing: ")]
    assert len(lines) == documents - 1 and lines[0].startswith(f"tokenizing: 1 of {documents:,} documents, ")


def test_cache_is_built_once_and_splits_by_document(tiny_paths):
    cfg = data_config(tiny_paths, validation_split=0.3)
    folder = build_cache(cfg, tiny_paths["cache"])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokens"]["train"] > 0 and meta["tokens"]["val"] > 0
    mtime = (folder / "train.bin").stat().st_mtime_ns
    assert build_cache(cfg, tiny_paths["cache"]) == folder and (folder / "train.bin").stat().st_mtime_ns == mtime
    assert cache_key(data_config(tiny_paths, validation_split=0.1)) != cache_key(cfg)
    # documents are joined with the end-of-text token
    eos = special_token_ids(tiny_paths["tokenizer"])["eos_token"]
    stream = np.fromfile(folder / "train.bin", dtype=meta["dtype"])
    assert stream[-1] == eos and (stream == eos).sum() >= 1


def test_packed_windows_shift_labels_by_one(tiny_paths):
    cfg = data_config(tiny_paths)
    data = TrainingData(cfg, build_cache(cfg, tiny_paths["cache"]), dp_rank=0, dp_size=1, seed=0)
    inputs, labels = data.train.batch(np.array([0, 1]))
    assert inputs.shape == labels.shape == (2, 16)
    assert (inputs[0, 1:] == labels[0, :-1]).all() and labels[0, -1] == inputs[1, 0]


@settings(max_examples=40, deadline=None)
@given(num_sequences=st.integers(3, 50), dp=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 4),
       step=st.integers(1, 40), seed=st.integers(0, 3))
def test_ranks_read_disjoint_parts_whose_union_is_the_global_batch(num_sequences, dp, per_rank, step, seed):
    global_batch = dp * per_rank
    single = BatchPlan(num_sequences, global_batch, 0, 1, seed)
    parts = [BatchPlan(num_sequences, global_batch, r, dp, seed).rank_indices(step) for r in range(dp)]
    assert np.array_equal(np.concatenate(parts), single.global_indices(step))
    assert np.array_equal(single.global_indices(step), BatchPlan(num_sequences, global_batch, 0, 1, seed).global_indices(step))
    # within one epoch no sequence repeats: positions map through a permutation
    epoch = np.concatenate([single.global_indices(s) for s in range(1, 200)])[:num_sequences]
    assert sorted(epoch.tolist()) == list(range(num_sequences))


def test_validation_windows_are_split_across_ranks(tiny_paths):
    cfg = data_config(tiny_paths, validation_split=0.3, eval_sequences=10)
    folder = build_cache(cfg, tiny_paths["cache"])
    shares = [TrainingData(cfg, folder, r, 3, 0).val_indices() for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 3]
    assert len(set(np.concatenate(shares).tolist())) == 9
