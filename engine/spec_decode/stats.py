"""Counters of speculative decoding (vLLM's ``spec_decode_*`` metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals since the engine started.

    Attributes:
        num_drafts: verification steps of requests that had drafts.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, accepted.
        num_accepted_tokens_per_pos: accepted drafts by position in the draft
            (index 0: first draft), ``num_speculative_tokens`` entries.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of ``num_draft_tokens`` drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step, bonus included (1 + accepted / drafts);
        1.0 before any draft."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)
