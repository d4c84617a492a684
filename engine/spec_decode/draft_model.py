"""Draft-model drafting: a (smaller) model with the target's tokenizer runs ``k``
autoregressive steps per request, on the same worker, in its own paged KV cache.

Each request's draft KV is kept between steps: before drafting, the draft model
catches up on the tokens it has not seen (the whole prompt the first time - on a
decode worker, where the prompt's KV arrived from a prefill worker, the draft
model computes its own prompt KV - then the accepted drafts' last token and the
bonus token), and the KV of rejected drafts is simply overwritten later, as in
the target's cache. Sampled requests draw their drafts from the draft model's
processed distribution (the request's own temperature, top-k, top-p, min-p and
penalties), which the verifier needs for ``min(1, p/q)``; greedy requests draft
the draft model's argmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.sampling.sampler import (DraftHistory, Sampler, apply_penalties_and_masks,
                                            draw_proportional, needs_processing, processed_probs)
from tandem.engine.spec_decode.proposer import Proposal, Proposer, register_proposer

logger = logging.getLogger(__name__)

_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15
"""Mixed into a seeded request's seed for its draft stream, so the draft model's
draws never share the verifier's generator."""


@dataclass
class _DraftState:
    """One request's draft KV: ``tokens[:num_computed]`` have KV in the draft cache."""

    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    limit = min(limit, len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    """Drafts with a second model (or the target itself: self-drafting).

    With a tensor-parallel target (``engine.parallel``) the draft model is whole on
    rank 0 and runs there only, in its own KV cache, which the other ranks never
    hear of; the target's verification forward is the sharded runner's, as any
    step's. Self-drafting then loads a whole copy of the target's file (a rank holds
    only its shard).

    Args:
        config: the :class:`~tandem.engine.config.SpeculativeConfig` (``draft_model``,
            ``num_speculative_tokens``, ``draft_num_blocks``).
        engine: the target :class:`~tandem.engine.runtime.llm_engine.LLMEngine`;
            its dtype, device, block size and attention backend are used, and its
            weights when the draft model is the target's own file (unsharded).

    Raises:
        ValueError: the draft model's vocabulary differs from the target's.
    """

    def __init__(self, config, engine):
        from tandem.engine.model.loader import load_model
        from tandem.engine.model.model_files import resolve_model
        from tandem.engine.runtime.model_runner import KVCache
        from tandem.kernels.registry import get_attention_backend

        ec = engine.config
        self.k = config.num_speculative_tokens
        self.device = engine.device
        try:
            files = resolve_model(config.draft_model) if config.draft_model else engine.model_files
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"draft_model: {exc}") from exc
        self.self_draft = files == engine.model_files
        if self.self_draft and engine.parallel is not None:
            # A sharded target: the draft runs unsharded on rank 0 alone (a draft
            # tensor-parallel size of 1, as vLLM allows), so it cannot share the
            # target's shard (its collectives, its announced forward): a whole copy
            # of the same weights in the same format.
            self.model, self.model_config = load_model(
                files, ec.torch_dtype, self.device, ec.quantization, ec.batch_invariant,
                ec.activation_quantization)
        elif self.self_draft:
            self.model, self.model_config = engine.model, engine.model_config
        else:
            self.model, self.model_config = load_model(files, ec.torch_dtype, self.device,
                                                       "none", ec.batch_invariant)
        if self.model_config.vocab_size != engine.model_config.vocab_size:
            raise ValueError(f"draft_model: its vocabulary has {self.model_config.vocab_size} "
                             f"tokens, the target's {engine.model_config.vocab_size}; "
                             "a draft model must share the target's tokenizer")
        self.block_size = ec.cache.block_size
        num_blocks = config.draft_num_blocks or engine.kv_cache.num_blocks
        self.kv_cache = KVCache(self.model_config, num_blocks, self.block_size, ec.torch_dtype,
                                self.device)
        self.kv = KVCacheManager(num_blocks, self.block_size, enable_caching=False)
        self.backend = get_attention_backend(ec.attention_backend, self.device, ec.torch_dtype,
                                             ec.batch_invariant)
        # The draft's own per-request generators (see _draw).
        self.sampler = Sampler(torch.Generator().manual_seed(_DRAFT_SEED_SALT), _DRAFT_SEED_SALT)
        self._states: dict[str, _DraftState] = {}
        self.num_skipped = 0
        """Proposals skipped because the draft cache had no room (requests, total)."""

    # -- state --------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        if self._states.pop(request_id, None) is not None:
            self.kv.free(request_id)
        self.sampler.free(request_id)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        for rid, st in self._states.items():
            assert self.kv.num_blocks_of(rid) * self.block_size >= st.num_computed, (
                f"draft state of {rid!r}: {st.num_computed} tokens in "
                f"{self.kv.num_blocks_of(rid)} blocks")

    @property
    def num_tracked_requests(self) -> int:
        """Requests holding draft KV."""
        return len(self._states)

    # -- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests, max_tokens):
        batch = []          # (request, state, k, tokens to feed, their start position)
        for req in requests:
            rid = req.request_id
            k = min(self.k, max_tokens[rid])
            tokens = req.all_token_ids
            st = self._states.get(rid) or _DraftState()
            start = _common_prefix(st.tokens, tokens, st.num_computed)
            feed = tokens[start:]
            if not self.kv.allocate_slots(rid, start, len(feed) + k - 1):
                self.free(rid)          # retried from scratch in a later step
                self.num_skipped += 1
                continue
            self._states[rid] = st
            batch.append((req, st, k, feed, start))
        if not batch:
            return {}
        drafts: dict[str, list[int]] = {req.request_id: [] for req, *_ in batch}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, *_ in batch}
        step = [(req, feed, start) for req, _, _, feed, start in batch]
        for j in range(max(k for _, _, k, _, _ in batch)):
            logits = self._forward(step)
            for (req, _, _), row in zip(step, logits):
                token, q = self._draw(row, req, drafts[req.request_id])
                drafts[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
            # Next: the drafts just drawn, for the requests that want more.
            step = [(req, [drafts[req.request_id][-1]], req.num_tokens + j)
                    for req, _, k, _, _ in batch if k > j + 1]
        out: dict[str, Proposal] = {}
        for req, st, k, _, _ in batch:
            d = drafts[req.request_id]
            st.tokens = req.all_token_ids + d[:-1]
            st.num_computed = len(st.tokens)
            q = probs[req.request_id]
            out[req.request_id] = Proposal(tuple(d), torch.stack(q) if q else None)
        return out

    def _forward(self, step) -> torch.Tensor:
        """Run ``step`` (``(request, token ids, start)``, any order) through the draft
        model; returns the float32 logits of each entry's last token, ``[len(step), V]``."""
        from tandem.engine.runtime.model_runner import pack_chunks

        order = sorted(range(len(step)), key=lambda i: len(step[i][1]) != 1)
        chunks = [(step[i][1], step[i][2], self.kv.get_block_ids(step[i][0].request_id))
                  for i in order]
        input_ids, positions, meta = pack_chunks(chunks, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache.tensor, meta, self.backend, None)
        last = torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i in range(len(order))],
                            device=hidden.device)
        logits = self.model.compute_logits(hidden[last]).float().cpu()
        out = torch.empty_like(logits)
        out[torch.tensor(order)] = logits
        return out

    def _draw(self, row: torch.Tensor, req, drafts: list[int]) -> tuple[int, torch.Tensor | None]:
        """The next draft of ``req`` from the draft model's logits ``row`` ([V]),
        processed as the target's row will be; and the normalised distribution it
        was drawn from ([V] float32; None for greedy requests)."""
        view = DraftHistory(req, drafts)
        if needs_processing(view):
            row = row.clone()
            apply_penalties_and_masks(row, view)
        if req.sampling_params.greedy:
            return int(row.argmax()), None
        q = processed_probs(row, req.sampling_params)
        q = q / q.sum()
        return draw_proportional(q, self.sampler.generator_for(req)), q
