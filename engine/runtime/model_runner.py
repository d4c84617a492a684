"""Runs one scheduled step on the model: builds the packed batch, forwards, samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.kv.kv_connector import KVConnector, KVSave
from tandem.engine.model.layers import DecoderForCausalLM
from tandem.engine.runtime.huge_pages import zeros_in_huge_pages
from tandem.engine.scheduling.request import Request, TokenLogprobs
from tandem.engine.sampling.grammar import StructuredOutputManager
from tandem.engine.sampling.sampler import SampleResult, Sampler, gather_logprobs
from tandem.engine.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput
from tandem.kernels import int4_kv
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata


PROMPT_LOGITS_SLICE_BYTES = 64 << 20
"""Prompt logprobs: float32 logits computed per slice of rows (64 MiB: 341 rows at
SmolLM2's 49,152-token vocabulary, 130 at Llama 3's 128,256; their log_softmax
takes as much again), so a 2,048-token prefill chunk (402 MiB of logits at 49,152)
never holds its ``[T, V]`` logits at once."""


class KVCache:
    """The paged KV cache of one worker, and its host-memory swap space.

    ``tensor`` is ``[L, 2, NB, BS, Hkv, D]`` (layer, K/V, block, offset in block,
    KV head, head dim); one block of one layer is ``tensor[l, :, b]``
    (``2 * BS * Hkv * D`` elements). One tensor for all layers lets the KV
    transfer and swap address a block across layers with a single index.
    ``host_tensor`` is ``[L, 2, NHB, BS, Hkv, D]`` on the CPU (pinned when the
    device is CUDA, so copies to and from it run at full link speed); host block
    ``h`` holds a swapped-out device block.

    With an fp8 cache (``dtype`` ``torch.float8_e4m3fn``, ``kv_cache_dtype
    fp8_e4m3``) both tensors hold the quantized bytes, and ``scales`` ``[L, 2, Hkv]``
    float32 on the device are the per-(layer, K/V, KV head) scales they were
    quantized with (see :mod:`tandem.engine.runtime.kv_scales`): fixed for the
    cache's lifetime, so a block copied, swapped or transferred keeps its meaning.

    With an int4 cache (``dtype`` ``torch.uint8``, ``kv_cache_dtype int4``; format in
    :mod:`tandem.kernels.int4_kv`) the last dim is the packed row's bytes, and
    ``open_keys`` ``[L, S, BS, Hkv, D]`` in ``model_dtype`` holds the exact K of the
    tokens of open (not yet full) blocks, one entry per open block, until the
    step that fills a block quantizes its K per channel from it. Entries follow
    their blocks through copy-on-write and swap (:meth:`copy_blocks`,
    :meth:`swap_out`, :meth:`swap_in`), are dropped when a block is released or
    handed to a new owner (:meth:`blocks_released`, :meth:`blocks_allocated`, wired
    to the block pool). ``S`` starts at ``open_entries`` (the engine passes
    ``max_num_seqs``, one open last block per running sequence, and counts those
    bytes in its KV budget, :meth:`open_entry_bytes`) and grows (doubling) if more
    blocks are open at once: forked samples copying a shared open block while it
    is still held.

    Args:
        dtype: storage dtype (the model dtype, ``torch.float8_e4m3fn``, or
            ``torch.uint8`` for int4).
        num_host_blocks: blocks of ``host_tensor`` (0: no swap space).
        scales: ``[L, 2, Hkv]`` float32, required for (and only for) an fp8 cache.
        model_dtype: the model's dtype, required for an int4 cache (its open-block
            K store).
        open_entries: int4: the store's first number of entries (None: 8).

    Raises:
        ValueError: an fp8 dtype without scales (or of another shape), scales for
            a cache in another dtype, an int4 cache without ``model_dtype`` or
            with a block size that does not divide ``4 * head_dim``.
    """

    _INITIAL_OPEN_ENTRIES = 8

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_host_blocks: int = 0,
                 scales: torch.Tensor | None = None, model_dtype: torch.dtype | None = None,
                 open_entries: int | None = None):
        if (dtype == torch.float8_e4m3fn) != (scales is not None):
            raise ValueError("scales: required for a float8_e4m3fn KV cache, and only for one")
        if scales is not None:
            if tuple(scales.shape) != (cfg.num_layers, 2, cfg.num_kv_heads):
                raise ValueError(f"scales: expected shape {(cfg.num_layers, 2, cfg.num_kv_heads)}, "
                                 f"got {tuple(scales.shape)}")
            scales = scales.to(device=device, dtype=torch.float32).contiguous()
        self.scales = scales
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_host_blocks = num_host_blocks
        self.head_dim = cfg.head_dim
        row = KVCache.row_width(cfg, dtype, block_size)
        self.open_keys: torch.Tensor | None = None
        if dtype == torch.uint8:
            if model_dtype is None:
                raise ValueError("model_dtype: required for an int4 KV cache")
            entries = max(1, open_entries or self._INITIAL_OPEN_ENTRIES)
            self.open_keys = torch.zeros(cfg.num_layers, entries, block_size,
                                         cfg.num_kv_heads, cfg.head_dim, dtype=model_dtype,
                                         device=device)
            self._entry_of: dict[int, int] = {}                 # block id -> entry
            self._free_entries = list(range(entries - 1, -1, -1))
            self._host_open: dict[int, torch.Tensor] = {}       # host block -> [L, BS, Hkv, D]
            self._released: set[int] = set()
        self.block_events: list[tuple[str, list[int]]] | None = None
        """When a list (a tensor-parallel rank 0 sets it): each :meth:`blocks_allocated`
        and :meth:`blocks_released` call of an int4 cache appends ``(name, block
        ids)``, so the other ranks can replay them on their caches."""
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, row)
        if device.type == "cpu":
            self.tensor = zeros_in_huge_pages(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        # Not zeroed: a host block is always written by a swap-out before it is read.
        self.host_tensor = torch.empty(cfg.num_layers, 2, num_host_blocks, block_size,
                                       cfg.num_kv_heads, row, dtype=dtype,
                                       pin_memory=device.type == "cuda")

    @staticmethod
    def row_width(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        """Last dim of the cache: ``head_dim`` elements, or for int4 (``uint8``) the
        packed row's bytes (:func:`~tandem.kernels.int4_kv.int4_kv_row_bytes`, 48
        for a head dim of 64 and blocks of 16).

        Raises:
            ValueError: int4 with a head dim that is not a multiple of 8, or a block
                size that does not divide ``4 * head_dim``.
        """
        if dtype == torch.uint8:
            return int4_kv.int4_kv_row_bytes(cfg.head_dim, block_size)
        return cfg.head_dim

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V, stored as ``dtype`` (the
        KV cache's: 1 byte per element for fp8, 2 for bfloat16, 4 for float32,
        the packed row's bytes per token and head for int4)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return (cfg.num_layers * 2 * block_size * cfg.num_kv_heads
                * KVCache.row_width(cfg, dtype, block_size) * elem)

    @staticmethod
    def open_entry_bytes(cfg: ModelConfig, block_size: int, model_dtype: torch.dtype) -> int:
        """Bytes of one entry of an int4 cache's open-block K store, all layers: the
        exact K of one block (``block_size`` tokens) in ``model_dtype``."""
        elem = torch.empty((), dtype=model_dtype).element_size()
        return cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    # -- int4: the open-block K store -------------------------------------------------------

    def _drop_entry(self, block: int) -> None:
        entry = self._entry_of.pop(block, None)
        if entry is not None:
            self._free_entries.append(entry)

    def _new_entry(self, block: int) -> int:
        if not self._free_entries:
            old = self.open_keys
            n = old.shape[1]
            self.open_keys = torch.zeros(old.shape[0], 2 * n, *old.shape[2:], dtype=old.dtype,
                                         device=old.device)
            self.open_keys[:, :n] = old
            self._free_entries = list(range(2 * n - 1, n - 1, -1))
        entry = self._free_entries.pop()
        self._entry_of[block] = entry
        return entry

    def blocks_allocated(self, block_ids: list[int]) -> None:
        """The block pool handed these blocks to a new owner: forget their entries."""
        if self.open_keys is not None:
            if self.block_events is not None:
                self.block_events.append(("allocated", list(block_ids)))
            for b in block_ids:
                self._drop_entry(b)
                self._released.discard(b)

    def blocks_released(self, block_ids: list[int]) -> None:
        """These blocks reached ref count 0: their entries go at the next
        :meth:`plan_int4_write`, after this step's swaps and copies used them."""
        if self.open_keys is not None:
            if self.block_events is not None:
                self.block_events.append(("released", list(block_ids)))
            self._released.update(b for b in block_ids if b in self._entry_of)

    @property
    def num_open_entries(self) -> int:
        """Blocks in use whose exact K the store holds (int4; 0 otherwise): the open
        blocks of running and swapped-in requests."""
        if self.open_keys is None:
            return 0
        return len(self._entry_of) - len(self._released & self._entry_of.keys())

    def plan_int4_write(self, slot_mapping: list[int], block_tables: torch.Tensor,
                        seq_lens: list[int]) -> int4_kv.Int4WritePlan:
        """Prepare the store for one step's cache write and say what the write does.

        ``slot_mapping`` holds the step's slots in packed order (each sequence's
        tokens consecutive, in position order); ``block_tables`` ``[B, max_blocks]``
        and ``seq_lens`` (``B`` ints, after the step) are the batch's, from which
        each sequence's open last block and its entry are found. Per block written: from offset 0
        to the end in this step -> quantized per channel from the step's K (no
        entry); otherwise its tokens' K go to its entry (new at offset 0; rebuilt
        from its per-token rows when the block arrived open without one), and if
        the step writes its last slot it is quantized per channel from the entry,
        which is then freed.
        """
        for b in self._released:
            self._drop_entry(b)
        self._released.clear()
        bs = self.block_size
        runs: list[list[int]] = []      # [block, first offset, last offset, first token]
        for t, slot in enumerate(slot_mapping):
            b, o = divmod(slot, bs)
            if runs and runs[-1][0] == b and runs[-1][2] == o - 1:
                runs[-1][2] = o
            else:
                runs.append([b, o, o, t])
        store_tokens: list[int] = []
        store_slots: list[int] = []
        fill_blocks, fill_entries, whole_blocks, whole_starts = [], [], [], []
        for b, first, last, t0 in runs:
            if first == 0 and last == bs - 1:
                self._drop_entry(b)
                whole_blocks.append(b)
                whole_starts.append(t0)
                continue
            if first == 0:
                self._drop_entry(b)
                entry = self._new_entry(b)
            elif b in self._entry_of:
                entry = self._entry_of[b]
            else:
                entry = self._new_entry(b)
                self._rebuild_entry(b, entry, first)
            store_tokens.extend(range(t0, t0 + last - first + 1))
            store_slots.extend(entry * bs + o for o in range(first, last + 1))
            if last == bs - 1:
                fill_blocks.append(b)
                fill_entries.append(entry)
        for b in fill_blocks:   # freed after the plan: no block of this step reuses them
            self._drop_entry(b)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        last_blocks = block_tables.cpu()[torch.arange(len(seq_lens)), (lens - 1) // bs].tolist()
        open_entries = [self._entry_of.get(b, -1) if n % bs else -1
                        for b, n in zip(last_blocks, seq_lens)]
        dev = self.tensor.device

        def ids(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        return int4_kv.Int4WritePlan(ids(store_tokens), ids(store_slots), ids(fill_blocks),
                                     ids(fill_entries), ids(whole_blocks), ids(whole_starts),
                                     ids(open_entries))

    def _rebuild_entry(self, block: int, entry: int, n: int) -> None:
        """Fill ``entry`` with block ``block``'s first ``n`` K values, decoded from its
        per-token rows (a block that arrived open, e.g. by KV transfer)."""
        rows = self.tensor[:, 0, block, :n]                            # [L, n, Hkv, R]
        self.open_keys[:, entry, :n] = int4_kv.dequantize_int4_tokens(rows, self.head_dim,
                                                                      self.open_keys.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: ``tensor[:, :, dst] = tensor[:, :, src]`` for each pair (and
        an int4 source's open-block entry)."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.tensor.device)
            dst = torch.tensor([c[1] for c in copies], device=self.tensor.device)
            self.tensor[:, :, dst] = self.tensor[:, :, src]
            if self.open_keys is not None:
                for s, d in copies:
                    self._drop_entry(d)
                    if s in self._entry_of:
                        source = self._entry_of[s]
                        entry = self._new_entry(d)      # may grow (replace) the store
                        self.open_keys[:, entry] = self.open_keys[:, source]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """``host_tensor[:, :, h] = tensor[:, :, d]`` for each ``(d, h)`` pair.

        Synchronous: the device blocks may be reused as soon as this returns.
        """
        if pairs:
            src = torch.tensor([d for d, _ in pairs], device=self.tensor.device)
            dst = torch.tensor([h for _, h in pairs])
            self.host_tensor[:, :, dst] = self.tensor[:, :, src].to("cpu")
            if self.open_keys is not None:
                for d, h in pairs:
                    self._host_open.pop(h, None)
                    if d in self._entry_of:
                        self._host_open[h] = self.open_keys[:, self._entry_of[d]].to(
                            "cpu", copy=True)
                        self._drop_entry(d)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """``tensor[:, :, d] = host_tensor[:, :, h]`` for each ``(h, d)`` pair."""
        if pairs:
            src = torch.tensor([h for h, _ in pairs])
            dst = torch.tensor([d for _, d in pairs], device=self.tensor.device)
            self.tensor[:, :, dst] = self.host_tensor[:, :, src].to(self.tensor.device)
            if self.open_keys is not None:
                for h, d in pairs:
                    self._drop_entry(d)
                    kept = self._host_open.pop(h, None)
                    if kept is not None:
                        entry = self._new_entry(d)      # may grow (replace) the store
                        self.open_keys[:, entry] = kept.to(self.open_keys.device)


@dataclass
class ModelRunnerOutput:
    """What one executed step produced.

    Attributes:
        sampled: request id -> sampled results, for every request whose chunk reached
            its last token (a parent with pending forks gets ``1 + len(forks)``).
        kv_save_failures: request id -> error message, for prompts whose KV the
            connector failed to send in this step.
        prompt_logprobs: request id -> :class:`TokenLogprobs` of the prompt positions
            this step scored, in order, continuing the request's
            :attr:`~Request.prompt_logprobs` (requests that asked for them only).
    """

    sampled: dict[str, list[SampleResult]] = field(default_factory=dict)
    kv_save_failures: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    """Turns a :class:`SchedulerOutput` into one forward pass and sampled tokens.

    Args:
        model: the loaded model, of any registered architecture (a
            :class:`~tandem.engine.model.layers.DecoderForCausalLM`).
        kv_cache: this engine's :class:`KVCache`.
        backend: attention backend.
        block_table_fn: request id -> its block ids (from the KV cache manager).
        kv_connector: a producer engine's connector: a request whose prompt completes
            in a step and that carries a ticket has each layer's KV sent from inside
            the forward pass, right after that layer is written.
        structured_outputs: the engine's grammar matchers (constrained requests'
            rows are masked by its sampler).

    Attributes:
        between_layers: None, or called with no arguments after each decoder layer
            of the next steps' forward passes, after that layer's KV transfer
            started (the engine loop sets it for a step on borrowed cores: core
            lending gives them back there, :meth:`CoreLending.give_back`).
    """

    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 block_table_fn, device: torch.device, seed: int = 0,
                 kv_connector: KVConnector | None = None,
                 structured_outputs: StructuredOutputManager | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_table_fn = block_table_fn
        self.device = device
        self.kv_connector = kv_connector
        self.between_layers: Callable[[], object] | None = None
        self.sampler = Sampler(torch.Generator().manual_seed(seed),
                               structured_outputs=structured_outputs)

    def prepare(self, scheduled: list[ScheduledRequest]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledRequest]]:
        """Pack the step's tokens, decodes first.

        Returns:
            ``(input_ids [T], positions [T], metadata, ordered)`` where ``ordered`` is
            the scheduled list in packed order.
        """
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        chunks = []
        for s in ordered:
            req = s.request
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if s.num_new_tokens == 1:
                ids = [_token_at(req, start)]
            elif s.spec_token_ids:
                ids = req.all_token_ids[start:] + list(s.spec_token_ids)
            else:
                ids = req.all_token_ids[start:end]
            chunks.append((ids, start, self.block_table_fn(req.request_id)))
        input_ids, positions, meta = pack_chunks(chunks, self.kv_cache.block_size, self.device)
        if getattr(self.model, "uses_prompt_lens", False):
            # longrope: the RoPE factors depend on the prompt's length
            meta = dataclasses.replace(meta, prompt_lens_cpu=[s.request.num_prompt_tokens
                                                              for s in ordered])
        return input_ids, positions, meta, ordered

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step.

        Block operations first, in the order :class:`SchedulerOutput` prescribes
        (swap-out, swap-in, copy-on-write); a step may consist of nothing else.
        """
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        self.kv_cache.copy_blocks(out.block_copies)
        if not out.scheduled:
            return ModelRunnerOutput()
        input_ids, positions, meta, ordered = self.prepare(out.scheduled)
        if self.kv_cache.open_keys is not None:
            meta = dataclasses.replace(meta, int4_plan=self.kv_cache.plan_int4_write(
                meta.slot_mapping.tolist(), meta.block_tables, meta.seq_lens_cpu))
        saves = self._kv_saves(out)
        if saves:
            self.kv_connector.start_save(saves)
        # Grammar masks of this step's sampled rows, computed while the model runs.
        self.sampler.prefetch_masks([r for s in ordered if s.samples and not s.spec_token_ids
                                     for r in (s.request, *s.request.pending_forks)])
        hidden = self.model(input_ids, positions, self.kv_cache.tensor, meta, self.backend,
                            self._after_layer(bool(saves)), kv_scales=self.kv_cache.scales,
                            open_keys=self.kv_cache.open_keys)
        failures = self.kv_connector.wait_for_save() if saves else {}
        return ModelRunnerOutput(self._sample(hidden, ordered, meta), failures,
                                 self._prompt_logprobs(hidden, ordered, meta))

    def _after_layer(self, saving: bool) -> Callable[[int], object] | None:
        """The forward pass's per-layer callback: the layer's KV transfer (``saving``),
        then :attr:`between_layers`."""
        save = self.kv_connector.save_kv_layer if saving else None
        hook = self.between_layers
        if hook is None:
            return save
        if save is None:
            return lambda i: hook()

        def both(i: int) -> None:
            save(i)
            hook()
        return both

    def _kv_saves(self, out: SchedulerOutput) -> list[KVSave]:
        """Requests whose prompt completes in this step and whose KV goes to a consumer."""
        if self.kv_connector is None:
            return []
        return [KVSave(s.request.request_id, s.request.kv_transfer_params,
                       tuple(self.block_table_fn(s.request.request_id)))
                for s in out.scheduled
                if s.samples and s.request.kv_transfer_params is not None
                and s.request.kv_transfer_params.ticket is not None]

    def _sample(self, hidden: torch.Tensor, ordered: list[ScheduledRequest],
                meta: AttentionMetadata) -> dict[str, list[SampleResult]]:
        rows: list[int] = []
        plain: list[int] = []                   # indices into rows sampled as usual
        row_requests: list[Request] = []
        owners: list[str] = []
        verified: list[tuple[ScheduledRequest, int]] = []    # (step, its first logits row)
        for i, s in enumerate(ordered):
            if not s.samples:
                continue
            last = meta.query_start_loc_cpu[i + 1] - 1
            if s.spec_token_ids:
                # k draft tokens: the k + 1 rows ending at the last verify them.
                verified.append((s, len(rows)))
                rows.extend(range(last - len(s.spec_token_ids), last + 1))
                continue
            # One row per sample (forks share the prompt's last row).
            for r in [s.request, *s.request.pending_forks]:
                plain.append(len(rows))
                rows.append(last)
                row_requests.append(r)
                owners.append(s.request.request_id)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).cpu()
        sampled: dict[str, list[SampleResult]] = {}
        if row_requests:
            results = self.sampler(logits[torch.tensor(plain)] if verified else logits,
                                   row_requests)
            for owner, res in zip(owners, results):
                sampled.setdefault(owner, []).append(res)
        for s, first in verified:
            k = len(s.spec_token_ids)
            sampled[s.request.request_id] = self.sampler.verify(
                logits[first:first + k + 1], s.request, s.spec_token_ids, s.spec_draft_probs)
        return sampled

    def _prompt_logprobs(self, hidden: torch.Tensor, ordered: list[ScheduledRequest],
                         meta: AttentionMetadata) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt tokens this step's chunks reach, for requests that asked.

        The logits at position ``q`` give prompt token ``q + 1``'s logprob, so a chunk
        over positions ``[start, end)`` scores tokens ``[start + 1, min(end + 1, P))``
        (``P`` prompt tokens; the last position's logits sample the first output
        token instead). Positions a request already has (it was preempted and is
        recomputed) are skipped. Logits are computed :data:`PROMPT_LOGITS_SLICE_BYTES`
        at a time.

        Raises:
            RuntimeError: a chunk starts past the positions scored so far (a prompt
                position would be missing: its KV came from somewhere else).
        """
        rows: list[int] = []
        token_ids: list[int] = []
        num_top: list[int] = []
        spans: list[tuple[str, int]] = []      # (request id, rows) in row order
        for i, s in enumerate(ordered):
            req = s.request
            if not req.needs_prompt_logprobs:
                continue
            start = s.num_computed_tokens
            first = len(req.prompt_logprobs)
            if first < start + 1:
                raise RuntimeError(f"request {req.request_id!r}: prompt logprobs of positions "
                                   f"{first}..{start} were never computed")
            stop = min(start + s.num_new_tokens + 1, req.num_prompt_tokens)
            if first >= stop:
                continue
            base = meta.query_start_loc_cpu[i] - start
            rows.extend(base + t - 1 for t in range(first, stop))
            token_ids.extend(req.prompt_token_ids[first:stop])
            num_top.extend([req.sampling_params.prompt_logprobs] * (stop - first))
            spans.append((req.request_id, stop - first))
        if not rows:
            return {}
        per_slice = max(1, PROMPT_LOGITS_SLICE_BYTES // (4 * self.model.cfg.vocab_size))
        scored: list[TokenLogprobs] = []
        for lo in range(0, len(rows), per_slice):
            idx = torch.tensor(rows[lo:lo + per_slice], device=hidden.device)
            scored.extend(gather_logprobs(self.model.compute_logits(hidden[idx]),
                                          token_ids[lo:lo + per_slice],
                                          num_top[lo:lo + per_slice]))
        out: dict[str, list[TokenLogprobs]] = {}
        pos = 0
        for rid, n in spans:
            out[rid] = scored[pos:pos + n]
            pos += n
        return out


def pack_chunks(chunks, block_size: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One forward pass's packed batch over a paged KV cache.

    Args:
        chunks: per sequence ``(token_ids, start, block_ids)``: the tokens to run
            at positions ``start, start + 1, ...`` and the sequence's block table
            (covering them). Sequences with one token (decodes) must come first.
        block_size: tokens per KV block.

    Returns:
        ``(input_ids [T] int64, positions [T] int64, metadata)``.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    for ids, start, block_ids in chunks:
        end = start + len(ids)
        input_ids.extend(ids)
        positions.extend(range(start, end))
        slots.extend(block_ids[p // block_size] * block_size + p % block_size
                     for p in range(start, end))
        seq_lens.append(end)
        qsl.append(qsl[-1] + len(ids))
    width = max(len(c[2]) for c in chunks)
    # One tensor from padded rows: a row-by-row copy costs a torch call per sequence.
    table = torch.tensor([list(c[2]) + [0] * (width - len(c[2])) for c in chunks],
                         dtype=torch.int32)
    num_decodes = 0
    while num_decodes < len(chunks) and len(chunks[num_decodes][0]) == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
    )
    return (torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device), meta)


def _token_at(req: Request, pos: int) -> int:
    n = req.num_prompt_tokens
    return req.prompt_token_ids[pos] if pos < n else req.output_token_ids[pos - n]
