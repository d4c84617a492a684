"""The engine: one model, one paged KV cache, one scheduler; ``step()`` is schedule ->
execute -> update."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from typing import Callable, Sequence

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv.kv_cache_manager import KVCacheManager, kv_sliding_window
from tandem.engine.kv.kv_connector import KVConnector, KVTransferParams, get_kv_connector
from tandem.engine.model.loader import load_model
from tandem.engine.model.model_files import resolve_model
from tandem.engine.model.moe import set_moe_dispatch
from tandem.engine.runtime.beam_search import BeamSearchManager, check_beam_request
from tandem.engine.runtime.kv_scales import (CALIBRATION_TEXT, calibrate_kv_scales,
                                             gather_model_kv_scales, kv_cache_torch_dtype)
from tandem.engine.runtime.model_runner import KVCache, ModelRunner
from tandem.engine.runtime.step_trace import StepTrace
from tandem.engine.sampling.grammar import StructuredOutputManager, get_grammar_backend_class
from tandem.engine.scheduling.request import (Request, RequestStatus, TokenLogprobs,
                                              sample_request_id)
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams
from tandem.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from tandem.engine.text.tokenizer import Tokenizer
from tandem.kernels.registry import get_attention_backend

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model, one paged KV cache, one scheduler: a colocated engine in one process.

    ``step()`` is schedule -> execute -> update. The workers of a cluster wrap
    this same engine.

    Args:
        config: the engine's :class:`EngineConfig`.
        tokenizer: pass one to share it; otherwise it is read from the model file.
        weights_from: another engine of the same model, dtype and device whose
            (read-only) weights this one shares instead of loading them again.
        kv_transport: the KV connector's transport config string (``gloo``, ``nccl``)
            for an engine of a disaggregated pair; None for a standalone engine.
        transfer_timeout_s: seconds a KV transfer may take before it counts as failed.
        enable_kv_events: record prefix-cache events (blocks stored / removed) for
            a router's prefix-aware routing (workers); off for offline use.

    With ``config.tensor_parallel_size`` above 1 this engine is rank 0 of a
    tensor-parallel group (:mod:`tandem.engine.parallel`): it starts the other
    ranks as worker processes, holds rank 0's shard and KV cache, and runs the
    scheduler and the sampler; :meth:`shutdown` stops the workers.

    Raises:
        ValueError: ``weights_from`` with ``tensor_parallel_size`` above 1, or
            ``kv_transport`` with it and a quantized KV cache.
    """

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 weights_from: "LLMEngine | None" = None, kv_transport: str | None = None,
                 transfer_timeout_s: float = 60.0, enable_kv_events: bool = False):
        self.config = config
        # config.num_threads is not applied here: the thread pool is the
        # process's (see tandem.engine.runtime.threads.apply_thread_settings).
        self.device = torch.device(config.device)
        self.model_files = resolve_model(config.model)
        self.parallel = comm = None
        """The :class:`~tandem.engine.parallel.group.TensorParallelGroup` of the other
        ranks (``tensor_parallel_size`` > 1), else None."""
        if config.tensor_parallel_size > 1:
            if weights_from is not None:
                raise ValueError("tensor_parallel_size: a sharded engine does not share "
                                 "weights_from another engine")
            from tandem.engine.parallel.group import TensorParallelGroup

            self.parallel = TensorParallelGroup.start(config)
            comm = self.parallel.comm
        pending_tokenizer = None
        if tokenizer is None and weights_from is None:
            # Loading the tokenizer is mostly importing transformers (~1 s of Python);
            # the model load is mostly memory copies that release the GIL: overlap them
            # (a worker's restart time, docs/control_plane.md).
            loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
            pending_tokenizer = loader.submit(Tokenizer, self.model_files)
            loader.shutdown(wait=False)     # its thread ends with the task
        if weights_from is not None:
            wc = weights_from.config
            if (weights_from.model_files, wc.dtype, weights_from.device, wc.quantization,
                    wc.batch_invariant, wc.activation_quantization, wc.small_batch_linear) != \
                    (self.model_files, config.dtype, self.device, config.quantization,
                     config.batch_invariant, config.activation_quantization,
                     config.small_batch_linear):
                raise ValueError("weights_from: model, dtype, device, quantization, "
                                 "batch_invariant, activation_quantization and "
                                 "small_batch_linear must match")
            self.model, self.model_config = weights_from.model, weights_from.model_config
            tokenizer = tokenizer or weights_from.tokenizer
        try:
            if weights_from is None:
                self.model, self.model_config = load_model(
                    self.model_files, config.torch_dtype, self.device, config.quantization,
                    config.batch_invariant, config.activation_quantization, comm=comm,
                    enable_expert_parallel=config.enable_expert_parallel,
                    small_batch_linear=config.small_batch_linear)
                set_moe_dispatch(self.model, config.moe_dispatch)
            self.backend = get_attention_backend(config.attention_backend, self.device,
                                                 config.torch_dtype, config.batch_invariant)
            # A model whose layers need what the backend lacks (a window, soft-capping,
            # experts in batch-invariant mode) is refused here, not at its first step.
            self.model.check_backend(self.backend)
        except BaseException:
            if self.parallel is not None:     # e.g. an architecture that does not shard
                self.parallel.shutdown()
            if pending_tokenizer is not None:
                # Let the tokenizer's import of transformers finish before the caller
                # can retry: a second engine importing it meanwhile sees a half
                # initialised module (ImportError).
                concurrent.futures.wait([pending_tokenizer])
            raise
        if pending_tokenizer is not None:
            tokenizer = pending_tokenizer.result()
        self.tokenizer = tokenizer or Tokenizer(self.model_files)
        cc = config.cache
        kv_dtype = kv_cache_torch_dtype(cc.kv_cache_dtype, config.torch_dtype)
        kv_scales = None
        if kv_dtype == torch.float8_e4m3fn:
            if weights_from is not None and weights_from.kv_cache.scales is not None:
                kv_scales = weights_from.kv_cache.scales     # same model: same calibration
            else:
                kv_scales = calibrate_kv_scales(
                    self.model, self.model_config, self.tokenizer.encode(CALIBRATION_TEXT),
                    config.torch_dtype, self.device)
        # All the model's KV heads' scales, what a KV transfer's handshake compares:
        # under tensor parallelism rank 0's own and the other ranks'.
        model_kv_scales = kv_scales
        if kv_scales is not None and comm is not None:
            model_kv_scales = gather_model_kv_scales(kv_scales, self.model_config, comm)
        # Under tensor parallelism every rank keeps the same blocks of its own heads:
        # rank 0's (the most heads) size them.
        kv_model_config = (self.model_config if self.parallel is None
                           else self.parallel.rank_model_config(self.model_config))
        bytes_per_block = KVCache.bytes_per_block(kv_model_config, cc.block_size, kv_dtype)
        open_entries = store_bytes = 0
        if kv_dtype == torch.uint8:
            # int4: the open-block K store (one entry per running sequence's open
            # last block) comes out of the same budget.
            open_entries = config.scheduler.max_num_seqs
            store_bytes = open_entries * KVCache.open_entry_bytes(
                self.model_config, cc.block_size, config.torch_dtype)
        if store_bytes and cc.num_blocks is None and \
                cc.kv_cache_memory_bytes < store_bytes + bytes_per_block:
            raise ValueError(
                f"kv_cache_memory_bytes: {cc.kv_cache_memory_bytes} bytes do not hold the int4 "
                f"open-block K store ({store_bytes} bytes for max_num_seqs {open_entries}) "
                f"and one block ({bytes_per_block} bytes)")
        num_blocks = cc.num_blocks or max(
            1, (cc.kv_cache_memory_bytes - store_bytes) // bytes_per_block)
        if config.scheduler.preemption_mode == "recompute":
            num_host_blocks = 0     # never swaps: no host memory to hold
        elif cc.num_host_blocks is not None:
            num_host_blocks = cc.num_host_blocks
        else:
            num_host_blocks = cc.swap_space_bytes // bytes_per_block
        self.kv_cache = KVCache(kv_model_config, num_blocks, cc.block_size, kv_dtype,
                                self.device, num_host_blocks, kv_scales, config.torch_dtype,
                                open_entries or None)
        if self.parallel is not None:
            self.parallel.setup_workers(num_blocks, num_host_blocks)
        prefix_caching = cc.enable_prefix_caching
        rope = self.model_config.rope_scaling
        if prefix_caching and rope is not None and rope.rope_type == "dynamic":
            # A cached key's rotation depends on the length of the prompt that computed
            # it (docs/models.md, "Dynamic NTK RoPE scaling"): a hit from a prompt of
            # another length would read wrongly rotated keys.
            logger.warning("prefix caching is off: RoPE scaling 'dynamic' rotates a "
                           "prompt's keys with a base set by the prompt's length")
            prefix_caching = False
        kv = self.kv_cache_manager = KVCacheManager(
            num_blocks, cc.block_size, prefix_caching, num_host_blocks,
            enable_kv_events, kv_sliding_window(self.model_config.layer_windows))
        if self.kv_cache.open_keys is not None:      # int4: entries follow their blocks
            pool = self.kv_cache_manager.block_pool
            pool.on_blocks_allocated = self.kv_cache.blocks_allocated
            pool.on_blocks_released = self.kv_cache.blocks_released
        # A lone request must always fit in the pool, or it could be preempted
        # forever (see the no-starvation argument in tandem.engine.scheduling.scheduler).
        # With a sliding window on every layer and chunked prefill, a step's blocks
        # are bounded by the window and the step's budget, not the sequence.
        pool_len = kv.num_usable_blocks * cc.block_size
        step_blocks = kv.max_blocks_per_step(config.scheduler.max_num_batched_tokens)
        if (config.scheduler.enable_chunked_prefill and step_blocks is not None
                and step_blocks <= kv.num_usable_blocks):
            pool_len = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len, pool_len)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len,
                                   bytes_per_block)
        self.kv_connector: KVConnector | None = None
        if kv_transport is not None:
            ranks = {} if self.parallel is None else {
                "ranks": self.parallel.kv_ranks(self.model_config)}
            self.kv_connector = get_kv_connector(kv_transport, self.kv_cache.tensor,
                                                 transfer_timeout_s=transfer_timeout_s,
                                                 kv_scales=model_kv_scales, **ranks)
        tok, vocab_size = self.tokenizer, self.model_config.vocab_size
        self.structured_outputs = StructuredOutputManager(
            lambda: get_grammar_backend_class()(tok, vocab_size), vocab_size, tok.eos_token_id)
        """Compiled grammars and the matchers of constrained requests (structured outputs)."""
        runner_class, runner_kwargs = ModelRunner, {}
        if self.parallel is not None:
            from tandem.engine.parallel.runner import TensorParallelModelRunner

            runner_class, runner_kwargs = TensorParallelModelRunner, {"comm": comm}
        self.runner = runner_class(self.model, self.kv_cache, self.backend,
                                   self.kv_cache_manager.get_block_ids, self.device,
                                   kv_connector=self.kv_connector,
                                   structured_outputs=self.structured_outputs, **runner_kwargs)
        self._ids = itertools.count()
        self.beam_search = BeamSearchManager(self)
        """Running beam searches (``params.use_beam_search``)."""
        self.last_step_ran = False    # whether the last step() scheduled anything
        self.last_step_tokens = 0     # tokens the last step() ran (prompt chunks + decodes)
        self.step_trace = StepTrace.from_env()
        """The step timeline (:mod:`~tandem.engine.runtime.step_trace`) when
        ``TANDEM_STEP_TRACE`` is set, else None."""
        self.num_first_tokens_from_peer = 0
        """Consumer side: remote prefills whose first token came on the KV channel."""
        self.num_first_tokens_from_caller = 0
        """Consumer side: remote prefills whose first token the caller gave
        (:meth:`start_decode`), the producer's handoff not having come first."""
        self.on_remote_first_token: Callable[[str], None] | None = None
        """Consumer side: called (on the engine's thread) with a request's id when its
        producer's first token, handed over on the KV channel, joined it: the caller
        already has that token from the producer (the serving loop marks it sent)."""
        self.proposer = None
        """Speculative decoding's :class:`~tandem.engine.spec_decode.proposer.Proposer`
        (None: off)."""
        if config.speculative is not None:
            from tandem.engine.spec_decode.factory import get_proposer

            self.proposer = get_proposer(config.speculative, self)
        self._spec_logged = (time.monotonic(), 0, 0, 0)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    kv_transfer_params: KVTransferParams | None = None,
                    output_token_ids: Sequence[int] = (),
                    output_logprobs: Sequence[TokenLogprobs] = (),
                    sample_index: int = 0) -> list[Request]:
        """Queue a prompt. Returns its ``params.n`` sample requests (index order).

        With ``params.use_beam_search`` it is a beam search of width ``n``
        (:mod:`tandem.engine.runtime.beam_search`): the requests returned are its
        results, filled with the beams (best first) and returned by :meth:`step`
        together, finished, when the search ends; ``abort_request(request_id)``
        aborts it. It takes no ``kv_transfer_params``, ``output_token_ids`` or
        ``sample_index`` (InvalidParameterError naming the field).

        With ``kv_transfer_params`` the prompt's KV crosses engines (see
        :mod:`tandem.engine.kv.kv_connector`): with a ticket, this (producer) engine
        sends it there once computed; without, this (consumer) engine reserves
        blocks in queue order and receives it from ``peer_id``, and the
        request's :attr:`Request.kv_load_ticket` is set in the step that reserved them.

        With ``output_token_ids`` the request resumes after tokens an earlier
        attempt already emitted (e.g. on a decode worker that died): it starts in
        the state of a recompute preemption, so the KV of prompt + those tokens
        is computed here (prefix-cache hits reused) and generation goes on as if
        never interrupted: ``max_tokens`` and ``min_tokens`` count them, the
        penalties see them as output, a seeded request's random stream skips one
        draw per token, and stop tokens are checked on new tokens only. Its
        prompt logprobs went out with its first token: they are not computed again.

        With ``params.prompt_logprobs`` the prompt is computed here whole (no
        prefix-cache hits) and its logprobs fill :attr:`Request.prompt_logprobs`.

        With ``params.structured_outputs`` the constraint is compiled here (cached
        by its text), so one that cannot compile is refused before it is queued;
        a resumed request's matcher replays its ``output_token_ids``.

        One sample of a parallel-sampling request resumes alone (``n == 1`` with
        ``sample_index`` i): a seeded one draws from sample i's stream
        (``sampling_params.sample_seed(i)``), so it goes on as sample i of the
        ``n``-sample request would have. Its engine id is
        ``sample_request_id(request_id, i)`` (``request_id#i``).

        Args:
            output_token_ids: tokens already generated for this request (n == 1).
            output_logprobs: their :class:`TokenLogprobs` (empty, or one per token).
            sample_index: which sample of its request this one is (n == 1 only).

        Raises:
            InvalidParameterError: empty prompt, unknown token ids, or prompt +
                max_tokens over the context limit (``field`` names the culprit);
                ``kv_transfer_params`` on an engine without a KV connector, with
                ``n > 1`` or with ``prompt_logprobs`` (they come from the engine
                that computes the prompt); ``output_token_ids`` with ``n > 1``, with
                ``kv_transfer_params``, with ids out of the vocabulary or as many
                as ``max_tokens``; ``output_logprobs`` of another length;
                ``sample_index`` negative, or not 0 with ``n > 1``.
                ``structured_outputs`` that does not compile (within
                :data:`~tandem.engine.sampling.grammar.COMPILE_TIMEOUT_S`):
                ``field`` ``structured_outputs.<json|regex|choice|grammar>``.
            ValueError: ``request_id`` is already in use.
        """
        ids = [int(t) for t in prompt_token_ids]
        outputs = [int(t) for t in output_token_ids]
        if not ids:
            raise InvalidParameterError("prompt_token_ids", "must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("prompt_token_ids",
                                        f"ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameterError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                              f"exceeds the maximum context length {self.max_model_len}")
        if kv_transfer_params is not None and (self.kv_connector is None or params.n > 1
                                               or params.prompt_logprobs is not None):
            raise InvalidParameterError("kv_transfer_params",
                                        "needs an engine with a KV connector, n == 1 and "
                                        "no prompt_logprobs")
        if params.use_beam_search:
            check_beam_request(params, kv_transfer_params=kv_transfer_params,
                               output_token_ids=outputs, sample_index=sample_index)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            return self.beam_search.add(rid, ids, params, priority)
        if sample_index < 0 or (sample_index and params.n > 1):
            raise InvalidParameterError("sample_index", f"{sample_index}: must be >= 0, and 0 "
                                                        "unless n == 1 (one sample alone)")
        if outputs:
            self._check_resumed(outputs, output_logprobs, params, kv_transfer_params)
            if params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=None)
        elif output_logprobs:
            raise InvalidParameterError("output_logprobs", "given without output_token_ids")
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        eos = self.tokenizer.eos_token_id
        first = Request(sample_request_id(rid, sample_index), ids, params, eos_token_id=eos,
                        priority=priority, kv_transfer_params=kv_transfer_params,
                        output_token_ids=outputs, output_logprobs=list(output_logprobs),
                        sample_index=sample_index, parent_id=rid if sample_index else None)
        first.pending_forks = [
            Request(sample_request_id(rid, i), ids, params, eos_token_id=eos, priority=priority,
                    arrival_time=first.arrival_time, sample_index=i, parent_id=rid,
                    status=RequestStatus.WAITING)
            for i in range(1, params.n)]
        requests = [first, *first.pending_forks]
        self.scheduler.add_request(first)
        # Only once the id is known to be free: the generator is keyed by it.
        self.runner.sampler.skip_draws(first, vocab, len(outputs))
        return requests

    def _check_resumed(self, outputs: list[int], output_logprobs: Sequence[TokenLogprobs],
                       params: SamplingParams, kv_transfer_params: KVTransferParams | None,
                       ) -> None:
        """Raise InvalidParameterError unless a resumed request's tokens can continue here."""
        if params.n > 1:
            raise InvalidParameterError("output_token_ids", "a resumed request needs n == 1")
        if kv_transfer_params is not None:
            raise InvalidParameterError("output_token_ids",
                                        "a resumed request is computed here, "
                                        "without kv_transfer_params")
        if len(outputs) >= params.max_tokens:
            raise InvalidParameterError(
                "output_token_ids", f"{len(outputs)} tokens already reach max_tokens "
                                    f"({params.max_tokens}): nothing is left to generate")
        vocab = self.model_config.vocab_size
        bad = [t for t in outputs if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("output_token_ids",
                                        f"ids out of range [0, {vocab}): {bad[:5]}")
        if output_logprobs and len(output_logprobs) != len(outputs):
            raise InvalidParameterError(
                "output_logprobs", f"{len(output_logprobs)} entries for {len(outputs)} "
                                   "output_token_ids (give none or one per token)")

    def start_decode(self, request_id: str, first_token_id: int | None,
                     first_logprobs: TokenLogprobs | None = None
                     ) -> tuple[int, TokenLogprobs | None] | None:
        """A remote-prefill request's prefill ended elsewhere (the caller's word; the
        producer's own word comes on the KV channel, see :meth:`step`).

        Args:
            first_token_id: the token the prefill engine sampled; the request joins
                the running batch once its KV landed. None: the remote prefill
                failed, and the prompt is computed here instead (once no layer can
                land in its reserved blocks any more).

        Returns:
            The first token ``(token id, logprobs or None)`` if the producer had
            already handed it over on the KV channel (the request decodes on; given
            ``None``, the caller never got that token and must pass it on), else None.

        Raises:
            KeyError: the request is not waiting for remote KV (e.g. aborted).
        """
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.first_token_from_peer:
            return req.output_token_ids[0], (req.output_logprobs[0] if req.output_logprobs
                                             else None)
        if first_token_id is None:
            if self.scheduler.give_up_remote_prefill(request_id):
                self.kv_connector.cancel_load(request_id)
            return None
        req = self.scheduler.set_remote_first_token(request_id, first_token_id, first_logprobs)
        self.runner.sampler.skip_draws(req, self.model_config.vocab_size, 1)
        self.num_first_tokens_from_caller += 1
        return None

    def _take_first_token(self, request_id: str, token_id: int,
                          logprobs: TokenLogprobs | None) -> None:
        """The producer handed over ``request_id``'s first token on the KV channel:
        take it if the request still waits for it (not given up, not aborted)."""
        req = self.scheduler.requests.get(request_id)
        if (req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KV
                or not req.needs_remote_kv or req.num_output_tokens):
            return
        if not 0 <= token_id < self.model_config.vocab_size:
            logger.warning("request %s: dropped a first token out of the vocabulary (%d)",
                           request_id, token_id)
            return
        self.scheduler.set_remote_first_token(request_id, token_id, logprobs)
        self.runner.sampler.skip_draws(req, self.model_config.vocab_size, 1)
        req.first_token_from_peer = True
        self.num_first_tokens_from_peer += 1
        if self.on_remote_first_token is not None:
            self.on_remote_first_token(request_id)

    def _hand_over_first_tokens(self, changed: list[Request]) -> None:
        """Producer side: give each consumer the first token of a prompt whose KV this
        step sent (the save succeeded and the token was sampled); a channel that
        fails now fails the request (``error``), as a failed save does."""
        for r in changed:
            p = r.kv_transfer_params
            if (p is None or p.ticket is None or not r.output_token_ids
                    or r.status.finish_reason not in ("length", "stop")):
                continue
            error = self.kv_connector.send_first_token(
                p, r.output_token_ids[0], r.output_logprobs[0] if r.output_logprobs else None)
            if error is not None:
                r.status, r.stop_reason = RequestStatus.FINISHED_ERROR, f"first token handoff: {error}"

    def extend_kv_load(self, request_id: str, timeout_s: float) -> bool:
        """Keep a remote-prefill request's KV load waiting at least ``timeout_s`` more
        seconds: its prefill worker is busy, the prompt queued there (see
        :meth:`KVConnector.extend_load`). Returns whether a load was in flight."""
        return self.kv_connector is not None and self.kv_connector.extend_load(request_id, timeout_s)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (and its pending forks); frees its blocks (those a remote KV
        load may still write once the load ended). False if unknown."""
        if request_id in self.beam_search:
            return self.beam_search.abort(request_id)
        if self.scheduler.abort_request(request_id) is None:
            return False
        self.runner.sampler.free(request_id)
        if self.proposer is not None:
            self.proposer.free(request_id)    # forks that never started drafted nothing
        if request_id in self.scheduler.remote_kv.orphaned:
            self.kv_connector.cancel_load(request_id)
        return True

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """End a request from outside the scheduler (a matched stop string); frees
        its blocks and its sampler state. Unknown or finished ids are ignored."""
        self.runner.sampler.free(request_id)
        if self.proposer is not None:
            self.proposer.free(request_id)
        self.scheduler.finish_request(request_id, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration: schedule, execute, update.

        Returns:
            Requests that got a token or finished in this step.
        """
        sch, connector = self.scheduler, self.kv_connector
        if connector is not None:
            for rid, error in connector.get_finished_loads():
                sch.finish_kv_load(rid, error is None)
            for rid, token_id, logprobs in connector.get_first_tokens():
                self._take_first_token(rid, token_id, logprobs)
        out: SchedulerOutput = sch.schedule()
        self.last_step_ran = not out.is_empty
        self.last_step_tokens = out.num_tokens
        if out.is_empty:
            return []
        for req in out.kv_loads_to_start:
            req.kv_load_ticket = connector.start_load(
                req.request_id, self.kv_cache_manager.get_block_ids(req.request_id),
                sch.remote_kv.num_tokens_not_received(req), req.num_prompt_tokens,
                req.kv_transfer_params)
        trace = self.step_trace
        start = trace.now() if trace is not None else 0.0
        result = self.runner.execute(out)
        if trace is not None:
            trace.record(start, trace.now(), out.num_tokens, len(out.scheduled))
        failed = [sch.requests[rid] for rid in result.kv_save_failures]
        for req in failed:
            sch.finish_request(req.request_id, RequestStatus.FINISHED_ERROR,
                               result.kv_save_failures[req.request_id])
        changed = (out.kv_loads_to_start
                   + sch.update(out, result.sampled, result.prompt_logprobs) + failed)
        for r in changed:
            if r.is_finished:
                self.runner.sampler.free(r.request_id)
        if connector is not None:
            self._hand_over_first_tokens(changed)
        changed = self.beam_search.update(changed)
        if self.proposer is not None:
            self._propose(out, changed)
        return changed

    def _propose(self, out: SchedulerOutput, changed: list[Request]) -> None:
        """Speculative decoding: draft tokens for the running requests that decode next
        (they are verified in the next step); drop finished and preempted requests'
        drafting state."""
        for r in (*out.preempted, *changed):
            if r.is_finished or r.status is not RequestStatus.RUNNING:
                self.proposer.free(r.request_id)
        sch = self.scheduler
        ready, limits = [], {}
        for r in sch.running:
            limit = sch.max_spec_tokens(r)
            if limit > 0 and not r.pending_forks and r.num_computed_tokens == r.num_tokens - 1 \
                    and not r.sampling_params.use_beam_search:
                ready.append(r)
                limits[r.request_id] = limit
        for rid, proposal in self.proposer.propose(ready, limits).items():
            req = sch.requests[rid]
            req.spec_token_ids = list(proposal.token_ids)
            req.spec_draft_probs = proposal.probs
        self._log_spec_stats()

    def _log_spec_stats(self, every_s: float = 10.0) -> None:
        """Log the mean acceptance length of the last ``every_s`` seconds (vLLM style)."""
        now = time.monotonic()
        st = self.scheduler.spec_stats
        t0, drafts0, tokens0, accepted0 = self._spec_logged
        if now - t0 < every_s or st.num_drafts == drafts0:
            return
        drafts, tokens = st.num_drafts - drafts0, st.num_draft_tokens - tokens0
        accepted = st.num_accepted_tokens - accepted0
        logger.info("speculative decoding: mean acceptance length %.2f (%d drafts, "
                    "%d of %d draft tokens accepted, %.1f%%)", 1 + accepted / drafts, drafts,
                    accepted, tokens, 100.0 * accepted / max(tokens, 1))
        self._spec_logged = (now, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (idempotent; nothing to do with
        one rank). The engine cannot step afterwards."""
        if self.parallel is not None:
            self.parallel.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
            self.step_trace = None

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far, swap and recompute together."""
        return self.scheduler.num_preemptions

    def check_invariants(self) -> None:
        """Check the scheduler's queues and both block pools (tests call it every step).

        Raises:
            AssertionError: naming the first violated invariant.
        """
        self.scheduler.check_invariants()
        if self.proposer is not None:
            self.proposer.check_invariants()

    def stats(self, worker_id: str = "engine", role: str = "colocated", num_step_tokens: int = 0
              ) -> "WorkerStats":
        """A snapshot of load and counters (see :class:`~tandem.engine.runtime.outputs.WorkerStats`)."""
        from tandem.engine.runtime.outputs import WorkerStats

        kv, sch = self.kv_cache_manager, self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sch.waiting
                     if not r.needs_remote_kv)
        queued += sum(r.num_tokens - r.num_computed_tokens - 1 for r in sch.running
                      if r.num_computed_tokens < r.num_tokens - 1)
        return WorkerStats(
            worker_id=worker_id, role=role, num_running=sch.num_running,
            num_waiting=sch.num_waiting, num_swapped=sch.num_swapped,
            num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_usable_blocks,
            kv_cache_usage=kv.usage, num_free_host_blocks=kv.num_free_host_blocks,
            num_host_blocks=kv.num_host_blocks, num_preemptions=sch.num_preemptions,
            num_swap_preemptions=sch.num_swap_preemptions,
            num_recompute_preemptions=sch.num_recompute_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_step_tokens=num_step_tokens,
            queued_prefill_tokens=queued,
            spec_decode_num_drafts=sch.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=sch.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=sch.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(
                sch.spec_stats.num_accepted_tokens_per_pos),
            structured_output_compiles=self.structured_outputs.num_compiles,
            structured_output_cache_hits=self.structured_outputs.num_cache_hits,
            structured_output_compile_seconds=self.structured_outputs.compile_seconds)
