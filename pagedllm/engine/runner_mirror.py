"""The scheduler's record of what the model runner holds of each sequence, so that a step ships
only what changed (step/scheduler_output.py).

For every sequence the runner has been sent: how many of its tokens, and the block table as it
was sent. A sequence the runner does not hold is described whole (`NewSequence`); one it holds,
by its new tokens and how its table changed since: blocks appended, the tail block replaced by
copy-on-write, or — when more than one entry changed (a swap-in gives fresh blocks) — the
whole table. Comparing against the table as sent, rather than tracking each change where it is
made, keeps the block manager unaware of the runner.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.sequence import Sequence
from pagedllm.step.scheduler_output import NewSequence, SequenceUpdate


@dataclass
class _Sent:
    num_tokens: int
    table: list[int]


class RunnerMirror:
    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def describe(self, seq: Sequence, table: list[int], forked_from: int | None = None) -> NewSequence | SequenceUpdate:
        """What the runner needs to hold `seq` as it is now (with block table `table`)."""
        sent = self._sent.get(seq.seq_id)
        if sent is None:
            self._sent[seq.seq_id] = _Sent(seq.num_tokens, list(table))
            request = seq.request
            return NewSequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, request.params, seq.index,
                               request.eos_token_ids, list(table), seq.num_computed_tokens, forked_from,
                               request.lora_request)
        update = SequenceUpdate(seq.seq_id, seq.num_computed_tokens, seq.token_ids[sent.num_tokens :])
        sent.num_tokens = len(seq.token_ids)
        if table != sent.table:
            _table_delta(update, sent.table, table)
            sent.table = list(table)
        return update

    def forget(self, seq_id: int) -> None:
        """The runner dropped the sequence (it finished, or its KV was dropped)."""
        self._sent.pop(seq_id, None)


def _table_delta(update: SequenceUpdate, sent: list[int], table: list[int]) -> None:
    """Blocks appended, and the changed entries of the part already sent (the whole table when
    more than one changed)."""
    head = table[: len(sent)]
    if head != sent:
        replaced = [(index, block) for index, (old, block) in enumerate(zip(sent, head)) if old != block]
        if len(replaced) > 1 or len(head) < len(sent):
            update.block_table = list(table)
            return
        update.replaced_blocks = replaced
    update.new_block_ids = table[len(sent) :]
