"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the
sequence's suffix (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method).

Editing, summarising and retrieval-augmented answers repeat long spans of their
prompt; there the tokens after an earlier occurrence of the last ``n`` tokens are
often the next ones. Costs no model, only a search per request and step.
"""

from __future__ import annotations

import numpy as np

from tandem.engine.spec_decode.proposer import Proposal, Proposer, register_proposer


def ngram_lookup(token_ids, min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """The ``k`` (or fewer) tokens that followed the most recent earlier occurrence of
    the sequence's longest matching suffix.

    Tries suffix lengths ``max_n`` down to ``min_n``; for the first that occurs
    earlier in ``token_ids`` (an occurrence ending before the suffix starts to
    end, so some token follows it), returns up to ``k`` tokens after its latest
    occurrence. ``()`` when no suffix of those lengths repeats.

    Args:
        token_ids: prompt + output so far (ints).
        min_n, max_n: suffix lengths in tokens, 1 <= min_n <= max_n.
        k: drafts wanted, >= 1.
    """
    n_tokens = len(token_ids)
    if n_tokens < min_n + 1:
        return ()
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = arr[-n:]
        # Windows starting at 0 .. n_tokens - n - 1: each is followed by a token.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(int(t) for t in arr[start:start + k])
    return ()


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Drafts by :func:`ngram_lookup` over prompt + output (point-mass proposals).

    Args:
        config: ``num_speculative_tokens``, ``prompt_lookup_min`` / ``_max``.
        engine: unused (the lookup needs no model).
    """

    def __init__(self, config, engine=None):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests, max_tokens):
        out: dict[str, Proposal] = {}
        for req in requests:
            drafts = ngram_lookup(req.all_token_ids, self.min_n, self.max_n,
                                  min(self.k, max_tokens[req.request_id]))
            if drafts:
                out[req.request_id] = Proposal(drafts)
        return out
