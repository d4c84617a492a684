"""The benchmarks' prompt workload, importable without torch (llama_cpp_peer.py runs in
a venv that has only llama-cpp-python)."""

from __future__ import annotations

import random


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab: int,
                  seed: int) -> list[list[int]]:
    """``num_prompts`` prompts as token id lists, each of a length drawn uniformly from
    ``[min_len, max_len]``, ids uniform in ``[100, vocab)``; the same for the same
    arguments on every machine (``random.Random(seed)``)."""
    rng = random.Random(seed)
    # Skip the first ids (special/control tokens in most vocabularies).
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]
