"""Chat and instruction data for fine-tuning: JSONL -> chat template -> tokens with a loss mask -> packed rows.

Each line is one example, either `{"messages": [...]}` in OpenAI's chat format (system / user /
assistant / tool messages, assistant tool_calls allowed) or `{"prompt": ..., "completion": ...}`
(a user turn and the assistant's answer). Every line is checked before training starts; a bad one
is refused as `file:line: why`, never skipped silently.

The conversation is rendered with the base model's own chat template, so the model is trained on
exactly the text it will be served. The loss is taken only on what the assistant says: for each
assistant message, the template is rendered up to it with the generation prompt, and up to and
including it; the characters in between (its content, tool calls and end-of-turn token, without
trailing whitespace) are the assistant's, and a token is trained on when it starts there. That
needs no template markup (TRL's {% generation %}) and works with any template that renders a
conversation's prefix as a prefix of its text.

Examples are packed best-fit decreasing into rows of sequence_length tokens (longest first, each
into the row it leaves least room in): every position of a row costs the same compute whether it
holds an example or padding, and this fills rows to ~96 % where packing in file order left ~81 %
(the varied-length set of `bench finetune`). Segment ids tell the model where each example starts
(no attention across examples, positions restart at 0); the row's unused tail is padding, never
trained on. Rows are drawn per step by the same BatchPlan as
text pre-training (data.py), so the order is a pure function of (seed, step) and resume is exact.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.training.config import DataConfig
from pagedllm.training.data import BatchPlan, RankSplits

log = logging.getLogger("pagedllm.training")

IGNORE = -100  # F.cross_entropy's ignore_index: labels the loss skips
ROLES = ("system", "user", "assistant", "tool")


class ChatDataError(ValueError):
    """A dataset line that cannot be trained on: the message is `file:line: why`."""


@dataclass
class Example:
    """One tokenized conversation: its tokens and, per token, whether the loss is taken on it."""

    ids: list[int]
    trained: list[bool]
    line: int


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return
    raise ValueError(f"{where}.content must be a string, null or a list of {{\"type\": \"text\", \"text\": ...}} parts")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must be {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")


def _flatten(message: dict) -> dict:
    """A message whose content parts are joined into one string (what chat templates expect)."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "".join(part["text"] for part in content)}
    return message


def messages_of(record: Any) -> list[dict]:
    """The conversation a parsed line holds; ValueError saying why it is not one."""
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object with 'messages', or 'prompt' and 'completion'")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ValueError(f"{where} must be an object whose role is one of {', '.join(ROLES)}")
            _check_content(message.get("content"), where)
            if message.get("tool_calls") is not None:
                if message["role"] != "assistant":
                    raise ValueError(f"{where}: only assistant messages have tool_calls")
                _check_tool_calls(message["tool_calls"], where)
            elif message.get("content") is None:
                raise ValueError(f"{where} has no content")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("no assistant message: nothing to train on")
        return [_flatten(m) for m in messages]
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise ValueError("'prompt' and 'completion' must both be strings (the completion non-empty)")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    raise ValueError("each line must have 'messages', or 'prompt' and 'completion'")


def read_conversations(path: str | Path) -> list[tuple[int, list[dict]]]:
    """(line number, messages) for every non-blank line of a JSONL file; ChatDataError at the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise ChatDataError(f"{path}: no such file (a fine-tune's dataset_path is one .jsonl file)")
    out = []
    with open(path, encoding="utf-8", errors="strict") as fh:
        try:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    out.append((number, messages_of(json.loads(line))))
                except json.JSONDecodeError as exc:
                    raise ChatDataError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                except ValueError as exc:
                    raise ChatDataError(f"{path}:{number}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ChatDataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not out:
        raise ChatDataError(f"{path}: no examples")
    return out


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of what each assistant message says."""
    text = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[:i + 1], False).rstrip()
        if not through.startswith(before) or not text.startswith(through):
            raise ValueError("the chat template does not render this conversation's beginning as a prefix of it, "
                             "so the assistant's tokens cannot be told apart")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], line: int = 0) -> Example:
    """Token ids of the rendered conversation, and which of them the loss is taken on."""
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoding["offset_mapping"]]
    return Example(list(encoding["input_ids"]), trained, line)


def is_validation_example(messages: list[dict], fraction: float) -> bool:
    """A stable per-example coin, from the example's content (the same split on every machine and run)."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity`: best-fit decreasing (each length,
    longest first, goes to the open row with the least room that still holds it; ties to the older
    row), O(n log n). Rows come out in the order they were opened, each row's indices ascending, so
    the result depends on the lengths alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i in order:
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k < len(room):
            free, r = room.pop(k)
        else:
            free, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        bisect.insort(room, (free - lengths[i], r))
    return [sorted(r) for r in rows]


class PackedRows:
    """One split as rows of `seq_len`: inputs, next-token labels (IGNORE where not trained) and segment ids."""

    def __init__(self, examples: list[Example], seq_len: int, pad_id: int) -> None:
        rows: list[tuple[list[int], list[int], list[int]]] = []
        for r in pack_best_fit([min(len(e.ids), seq_len + 1) - 1 for e in examples], seq_len):
            row: tuple[list[int], list[int], list[int]] = ([], [], [])
            for segment, i in enumerate(r):
                ids, trained = examples[i].ids[:seq_len + 1], examples[i].trained[:seq_len + 1]
                row[0].extend(ids[:-1])
                row[1].extend(tok if keep else IGNORE for tok, keep in zip(ids[1:], trained[1:]))
                row[2].extend([segment] * (len(ids) - 1))
            rows.append(row)
        self.inputs = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
        self.labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
        self.segments = torch.full((len(rows), seq_len), -1, dtype=torch.long)  # padding: its own segment
        for r, (inputs, labels, segments) in enumerate(rows):
            n = len(inputs)
            self.inputs[r, :n] = torch.tensor(inputs)
            self.labels[r, :n] = torch.tensor(labels)
            self.segments[r, :n] = torch.tensor(segments)
        self.num_sequences = len(rows)
        self.trained_tokens = int((self.labels != IGNORE).sum())

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return self.inputs[index], self.labels[index], self.segments[index]


def tokenize_examples(tokenizer, conversations: list[tuple[int, list[dict]]], path: str, seq_len: int) -> list[Example]:
    """Every conversation tokenized; one that leaves nothing to train on within seq_len + 1 tokens is dropped, with a warning."""
    examples, dropped = [], []
    for line, messages in conversations:
        try:
            example = tokenize_conversation(tokenizer, messages, line)
        except Exception as exc:  # the template's own errors (jinja raise_exception, a missing key)
            raise ChatDataError(f"{path}:{line}: the chat template cannot render it: {exc}") from None
        if any(example.trained[1:seq_len + 1]):
            examples.append(example)
        else:
            dropped.append(line)
    if dropped:
        log.warning("%s: %d example(s) have no assistant token within sequence_length %d and are skipped (lines %s)",
                    path, len(dropped), seq_len, dropped[:10])
    return examples


class ChatData(RankSplits):
    """The train and validation rows of a fine-tune, and this rank's share of each (data.TrainingData's interface)."""

    def __init__(self, data: DataConfig, tokenizer, dp_rank: int, dp_size: int, seed: int) -> None:
        conversations = read_conversations(data.dataset_path)
        val = [c for c in conversations if is_validation_example(c[1], data.validation_split)]
        if data.validation_split > 0 and not val and len(conversations) > 1:
            val = conversations[-1:]  # too few examples for the coin: hold out the last one
        held = {line for line, _ in val}
        train = [c for c in conversations if c[0] not in held]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        seq_len = data.sequence_length
        self.train = PackedRows(tokenize_examples(tokenizer, train, data.dataset_path, seq_len), seq_len, pad)
        self.val = PackedRows(tokenize_examples(tokenizer, val, data.dataset_path, seq_len), seq_len, pad)
        if self.train.num_sequences < 1:
            raise ChatDataError(f"{data.dataset_path}: no training example has an assistant token within sequence_length {seq_len}")
        self.plan = BatchPlan(self.train.num_sequences, data.global_batch_size, dp_rank, dp_size, seed)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.eval_sequences = data.eval_sequences

    def val_indices(self) -> np.ndarray:
        """This rank's rows of the first eval_sequences validation rows, every one of them on some rank
        (rank r takes r, r + dp, ...): a fine-tune's split is a handful of rows and its eval loss is per
        assistant token, so shares may differ by one row (the trainer pads them to equal batches)."""
        return np.arange(self.dp_rank, self.val_rows(), self.dp_size)

    def val_rows(self) -> int:
        return min(self.eval_sequences, self.val.num_sequences)

