"""Chat data: the label mask on a rendered conversation, packing, and bad lines refused with file:line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedllm.training.chat_data import (IGNORE, ChatData, ChatDataError, PackedRows, pack_best_fit, read_conversations,
                                         tokenize_conversation)
from pagedllm.training.trainer import packed_width
from pagedllm.training.config import DataConfig
from pagedllm.training.pretrained import base_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return base_tokenizer("@default")


def test_loss_only_on_assistant_tokens(smollm2_tokenizer):
    """SmolLM2's ChatML: exactly each answer and its <|im_end|> are trained on; the system prompt,
    the questions and the '<|im_start|>assistant' headers are not."""
    tok = smollm2_tokenizer
    example = tokenize_conversation(tok, CONVERSATION)
    assert tok.decode(example.ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    pieces, run = [], []
    for token, trained in zip(example.ids, example.trained):
        if trained:
            run.append(token)
        elif run:
            pieces.append(tok.decode(run))
            run = []
    assert pieces == ["Paris.<|im_end|>", "Rome.<|im_end|>"]


def test_prompt_completion_and_tool_calls(smollm2_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    data.write_text(json.dumps({"prompt": "2+2?", "completion": "4"}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Weather?"}, call,
                                               {"role": "tool", "content": "sunny"},
                                               {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]}) + "\n")
    (line1, first), (line3, second) = read_conversations(data)
    assert (line1, line3) == (1, 3)
    assert first == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert second[-1]["content"] == "Sunny."
    example = tokenize_conversation(smollm2_tokenizer, first)
    assert smollm2_tokenizer.decode([t for t, k in zip(example.ids, example.trained) if k]) == "4<|im_end|>"


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"text": "hi"}), "'messages', or 'prompt' and 'completion'"),
    (json.dumps({"messages": []}), "non-empty list"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
    (json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}), "messages[0].content"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": [{"function": {}}]}]}), "tool_calls[0]"),
    (json.dumps({"prompt": "x", "completion": 5}), "'prompt' and 'completion'"),
])
def test_bad_lines_are_refused_with_file_line_and_why(tmp_path, line, why):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "fine", "completion": "yes"}) + "\n" + line + "\n")
    with pytest.raises(ChatDataError) as err:
        read_conversations(data)
    assert str(err.value).startswith(f"{data}:2: ") and why in str(err.value)


def test_packing_keeps_examples_whole_and_masks_padding(smollm2_tokenizer, tmp_path):
    examples = [tokenize_conversation(smollm2_tokenizer, [{"role": "user", "content": f"Q{i}" * (i + 1)},
                                                          {"role": "assistant", "content": f"A{i}"}]) for i in range(6)]
    seq_len = max(len(e.ids) for e in examples) * 2
    rows = PackedRows(examples, seq_len, pad_id=0)
    assert rows.num_sequences < len(examples)  # several examples share a row
    for r in range(rows.num_sequences):
        segments = rows.segments[r].tolist()
        used = [s for s in segments if s >= 0]
        assert used == sorted(used) and segments[len(used):] == [-1] * (seq_len - len(used))
        assert (rows.labels[r, len(used):] == IGNORE).all()
    assert rows.trained_tokens == sum(sum(e.trained[1:]) for e in examples)


def test_best_fit_decreasing_fills_rows_that_file_order_leaves_half_empty():
    # in file order (a new row whenever the next does not fit): [3, 5], [2, 6], [4] -- three rows
    assert pack_best_fit([3, 5, 2, 6, 4], 10) == [[3, 4], [0, 1, 2]]
    lengths = [(7 * i) % 23 + 1 for i in range(200)]
    rows = pack_best_fit(lengths, 32)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    assert len(rows) <= -(-sum(lengths) // 32) + 2  # within two rows of perfect


def test_a_micro_batch_is_as_wide_as_its_longest_packed_row():
    segments = torch.tensor([[0, 0, 1, -1, -1, -1], [0, 0, 0, 0, -1, -1]])
    assert packed_width(segments) == 4
    assert packed_width(torch.full((2, 6), -1)) == 1


def test_validation_split_holds_out_examples(smollm2_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "completion": f"answer {i}"}) + "\n" for i in range(40)))
    cfg = DataConfig(dataset_path=str(data), sequence_length=64, global_batch_size=2, micro_batch_size=1,
                     validation_split=0.25)
    chat = ChatData(cfg, smollm2_tokenizer, 0, 1, seed=0)
    assert chat.val.num_sequences > 0 and chat.train.num_sequences > chat.val.num_sequences
    inputs, labels, segments = chat.step_batch(1)
    assert inputs.shape == labels.shape == segments.shape == (2, 64)
    assert np.array_equal(chat.val_indices(), np.arange(min(cfg.eval_sequences, chat.val.num_sequences)))
    # over 3 data-parallel ranks every validation row is evaluated once (pretraining's windows drop a remainder)
    shares = [ChatData(cfg, smollm2_tokenizer, r, 3, seed=0).val_indices() for r in range(3)]
    assert chat.val_rows() % 3 and sorted(np.concatenate(shares).tolist()) == list(range(chat.val_rows()))
