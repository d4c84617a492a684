"""The offline API, the vLLM way: ``LLM(model=...).generate(prompts, params)``.

This is the process's entry point in offline use: it builds one
:class:`~tandem.engine.runtime.llm_engine.LLMEngine` and runs it to completion.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence, Union

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.runtime.beam_search import BeamSearchOutput, BeamSearchParams
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.text.output_processor import OutputProcessor, RequestOutput
from tandem.engine.scheduling.request import Request, RequestStatus
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.runtime.threads import apply_thread_settings

PromptType = Union[str, dict, Sequence[int]]
"""One prompt of :meth:`LLM.generate`: text, ``{"prompt": text}``,
``{"prompt_token_ids": ids}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``) or token ids."""


class LLM:
    """Offline batch generation, the vLLM way: ``LLM(model=...).generate(prompts, params)``.

    Args:
        model: None (the default model), a .gguf file or a checkpoint directory.
        dtype: ``float32``, ``bfloat16`` (default) or ``float16``.
        block_size, num_blocks, kv_cache_memory_bytes, enable_prefix_caching,
        swap_space_bytes, num_host_blocks, kv_cache_dtype: see :class:`CacheConfig`
            (``kv_cache_dtype``: ``auto``, the model dtype, ``fp8_e4m3`` or ``int4``).
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, preemption_mode:
            see :class:`SchedulerConfig`.
        attention_backend: ``auto``, ``torch``, ``cpu`` or ``triton``.
        quantization: the linear layers' weight format (``EngineConfig.quantization``):
            ``none`` (dense in ``dtype``; a quantized checkpoint directory, GPTQ or AWQ,
            is loaded with the method its config.json names), ``gguf`` (a GGUF file's
            blocks kept packed), ``gptq``, ``awq``.
        activation_quantization: ``none`` or ``int8``
            (``EngineConfig.activation_quantization``).
        num_threads: torch intra-op threads. ``LLM`` is the process's entry
            point in offline use, so it applies them to the whole process
            (:func:`~tandem.engine.runtime.threads.apply_thread_settings`) before
            building its engine; None leaves them as they are (with
            ``tensor_parallel_size`` above 1: this process's cores shared evenly
            among the ranks, each rank's process setting its own).
        batch_invariant: see :class:`EngineConfig` (outputs independent of batch
            composition; CPU).
        small_batch_linear: see :class:`EngineConfig` (linear layers of steps of up
            to 1280 tokens on AMX tiles, of up to 256 by AVX-512 BF16 dot products
            without AMX, float32 ones of up to 1024 by AVX-512 FMAs, from a second copy
            of the weights; None: while it fits).
        speculative_config: speculative decoding, a
            :class:`~tandem.engine.config.SpeculativeConfig` or a dict of its fields
            (vLLM style: ``{"method": "ngram", "num_speculative_tokens": 4}``);
            None: off.
        weights_from: an existing ``LLM`` whose loaded weights to share.
        tensor_parallel_size: ranks the model is sharded over (``EngineConfig``):
            rank 0 runs here with the scheduler, the others as worker processes that
            :meth:`shutdown` stops (or this process's exit).
        enable_expert_parallel: a mixture-of-experts model's experts spread whole
            over the ``tensor_parallel_size`` ranks instead of each split over them.
        moe_dispatch: ``all_reduce`` or ``all_to_all``, how experts spread over the
            ranks meet the tokens (``EngineConfig``).

    Raises:
        ValueError: a bad configuration field (named in the message).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "bfloat16", device: str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int = 1 << 30, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, attention_backend: str = "auto",
                 max_model_len: int | None = None, num_threads: int | None = None,
                 preemption_mode: str = "auto", swap_space_bytes: int = 1 << 30,
                 num_host_blocks: int | None = None, batch_invariant: bool = False,
                 speculative_config: "SpeculativeConfig | dict | None" = None,
                 quantization: str = "none", kv_cache_dtype: str = "auto",
                 activation_quantization: str = "none", small_batch_linear: bool | None = None,
                 weights_from: "LLM | None" = None, tensor_parallel_size: int = 1,
                 enable_expert_parallel: bool = False, moe_dispatch: str = "all_reduce"):
        if isinstance(speculative_config, dict):
            unknown = set(speculative_config) - {f.name for f in dataclasses.fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"speculative_config: unknown field(s) {', '.join(sorted(unknown))}")
            if "method" not in speculative_config:
                raise ValueError("speculative_config: method is required (ngram or draft_model)")
            speculative_config = SpeculativeConfig(**speculative_config)
        if num_threads is None and isinstance(tensor_parallel_size, int) \
                and tensor_parallel_size > 1:
            from tandem.engine.parallel.group import threads_per_rank

            num_threads = threads_per_rank(tensor_parallel_size)
        self.config = EngineConfig(
            model=model, dtype=dtype, device=device, attention_backend=attention_backend,
            quantization=quantization, max_model_len=max_model_len, num_threads=num_threads,
            activation_quantization=activation_quantization,
            batch_invariant=batch_invariant, speculative=speculative_config,
            small_batch_linear=small_batch_linear, tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel, moe_dispatch=moe_dispatch,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              swap_space_bytes=swap_space_bytes, num_host_blocks=num_host_blocks,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      preemption_mode=preemption_mode))
        apply_thread_settings(self.config)
        self.engine = LLMEngine(self.config,
                                weights_from=weights_from.engine if weights_from else None)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (idempotent; nothing to
        do with ``tensor_parallel_size`` 1). Generation is over afterwards."""
        self.engine.shutdown()

    def generate(self, prompts: "PromptType | Sequence[PromptType]",
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 step_callback=None) -> list[RequestOutput]:
        """Generate completions for a batch of prompts.

        All prompts are queued at once and run with continuous batching.

        Args:
            prompts: one prompt or a list of them. A prompt is, as in vLLM, a string,
                ``{"prompt": str}`` (a ``TextPrompt``), ``{"prompt_token_ids":
                list[int]}`` (a ``TokensPrompt``), or a plain list of token ids.
            sampling_params: one for all prompts, or one per prompt (default
                ``SamplingParams()``: temperature 1, 16 tokens, as in vLLM).
            step_callback: called after every engine step (tests check invariants there).

        Returns:
            One :class:`RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a prompt of another form (a dict without either key, or with
                keys Tandem does not implement, such as ``multi_modal_data``; token ids
                that are not integers), or ``sampling_params`` not one per prompt.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: need one per prompt")
        token_lists = [self._prompt_token_ids(p, i) for i, p in enumerate(prompts)]
        return self._run(token_lists, params_list, step_callback)

    def beam_search(self, prompts: "PromptType | Sequence[PromptType]", params: BeamSearchParams,
                    step_callback=None) -> list[BeamSearchOutput]:
        """Beam search, vLLM's ``LLM.beam_search``, with Hugging Face transformers'
        algorithm and scores (``generate(num_beams=W, do_sample=False)``; see
        :mod:`tandem.engine.runtime.beam_search`).

        All prompts run at once, batched with each other: every beam is a sequence
        of the engine, and the beams of a prompt share the KV blocks of the prompt
        and of their common prefix (reference counts, copy-on-write).

        Args:
            prompts: one prompt or a list, in any form :meth:`generate` takes.
            params: a :class:`BeamSearchParams` (``beam_width`` 1..16).
            step_callback: called after every engine step (tests check invariants there).

        Returns:
            One :class:`BeamSearchOutput` per prompt, in input order: its
            ``beam_width`` finished beams, best ``score`` first
            (:class:`~tandem.engine.runtime.beam_search.BeamSearchSequence`:
            ``tokens`` prompt + output as in vLLM, ``output_token_ids``, ``text`` of
            the output, ``cum_logprob`` and ``score``).

        Raises:
            ValueError: a bad prompt (as :meth:`generate`), or ``params`` not a
                :class:`BeamSearchParams`; InvalidParameterError (a ValueError):
                prompt + ``max_tokens`` over the context length (``max_tokens``).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._prompt_token_ids(p, i) for i, p in enumerate(prompts)]
        engine, sp = self.engine, params.to_sampling_params()
        searches = []
        try:
            for ids in token_lists:
                rid = engine.add_request(ids, sp)[0].request_id
                searches.append(engine.beam_search.searches[rid])
            while engine.has_unfinished_requests():
                engine.step()
                if step_callback is not None:
                    step_callback(engine)
        except BaseException:
            for s in searches:       # their beams' blocks are freed
                engine.abort_request(s.request_id)
            raise
        for s in searches:
            for seq in s.sequences:
                seq.text = self.tokenizer.decode(seq.output_token_ids)
        return [BeamSearchOutput(s.sequences) for s in searches]

    def _prompt_token_ids(self, prompt: "PromptType", index: int) -> list[int]:
        """One prompt of any :meth:`generate` form -> its token ids (raises ValueError)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise ValueError(f"prompts[{index}]: unsupported key(s) {', '.join(unknown)} "
                                 "(a prompt is {'prompt': str} or {'prompt_token_ids': [int]})")
            if "prompt_token_ids" in prompt:
                if "prompt" in prompt:
                    raise ValueError(f"prompts[{index}]: give 'prompt' or 'prompt_token_ids', "
                                     "not both")
                return self._token_ids(prompt["prompt_token_ids"],
                                       f"prompts[{index}].prompt_token_ids")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"prompts[{index}].prompt: expected a string, got "
                                     f"{type(prompt['prompt']).__name__}")
                return self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"prompts[{index}]: a dict prompt needs 'prompt' or "
                             "'prompt_token_ids'")
        return self._token_ids(prompt, f"prompts[{index}]")

    @staticmethod
    def _token_ids(ids, field: str) -> list[int]:
        if isinstance(ids, (str, bytes, dict)):
            raise ValueError(f"{field}: expected a list of token ids, got {type(ids).__name__}")
        try:
            return [operator.index(t) for t in ids]
        except TypeError:
            raise ValueError(f"{field}: expected a list of integer token ids") from None

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | None = None, step_callback=None
             ) -> list[RequestOutput]:
        """Like :meth:`generate`, for chat conversations under the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        params = sampling_params or SamplingParams()
        return self._run(token_lists, [params] * len(token_lists), step_callback)

    def _run(self, token_lists, params_list, step_callback) -> list[RequestOutput]:
        engine = self.engine
        processor = OutputProcessor(self.tokenizer)
        groups: list[tuple[str, list[Request]]] = []
        for ids, params in zip(token_lists, params_list):
            reqs = engine.add_request(ids, params)
            for r in reqs:
                processor.add(r)
            groups.append((reqs[0].request_id, reqs))
        try:
            while engine.has_unfinished_requests():
                changed = engine.step()
                for req in changed:
                    stop = processor.process(req)
                    if stop is not None:
                        engine.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED,
                                              stop)
                if step_callback is not None:
                    step_callback(engine)
        except BaseException:
            # This call's requests die with it (their blocks freed), so the engine
            # serves the next call instead of resuming requests nobody collects.
            for _, reqs in groups:
                for r in reqs:
                    engine.abort_request(r.request_id)
            raise
        results = []
        for rid, reqs in groups:
            outs = [processor.completion(r) for r in reqs]
            first = reqs[0]
            prompt_lps = (list(first.prompt_logprobs)
                          if first.sampling_params.prompt_logprobs is not None else None)
            results.append(RequestOutput(rid, first.prompt_token_ids, outs,
                                         first.num_cached_tokens, prompt_lps))
        return results
