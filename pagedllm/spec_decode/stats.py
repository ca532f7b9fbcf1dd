"""Speculative decoding's counters (vLLM's spec_decode metrics) and what `get_stats()` reports
of them: drafts verified, tokens proposed and accepted, acceptances by position, the derived
rates and where the time went."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def report(self, draft_s: float, target_s: float) -> dict[str, Any]:
        """The counters, the acceptance rate and mean accepted length, and the draft's share of
        the time (`draft_s` proposing, `target_s` in the target's steps)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "spec_decode_draft_time_s": draft_s,
            "spec_decode_target_time_s": target_s,
            "spec_decode_draft_time_share": draft_s / (draft_s + target_s) if draft_s + target_s else 0.0,
        }
