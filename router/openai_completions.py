"""``POST /v1/completions`` of the OpenAI-compatible front end."""

from __future__ import annotations

import dataclasses
import time
import uuid

from tandem.router.generation_request import GenerationRequest
from tandem.router.openai_protocol import (_U32, APIError, CompletionRequest, MAX_BATCH_PROMPTS,
                                           _Usage, _check_failed, _refuse_unsupported,
                                           _sampling_fields, _stop_reason)
from tandem.router.validation import ValidatedRequest


class CompletionsServing:
    """``POST /v1/completions``: one request per prompt (a batch of prompts, each
    ``n`` choices), streamed or whole, with ``echo`` and prompt logprobs. A mixin of
    :class:`~tandem.router.openai_api.OpenAIServer`, whose shared state and helpers
    (``_validate``, ``_running``, ``_collect``, ``_sse``, ``_token_str``) it uses."""

    def _completion_requests(self, body: CompletionRequest) -> tuple[list[ValidatedRequest], list]:
        self._check_model(body.model)
        _refuse_unsupported(body)
        if body.suffix:
            raise APIError(400, "suffix: not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")
        p = body.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request, "
                                f"got {len(prompts)}", "prompt")
        sampling, constraint_param = _sampling_fields(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:     # the prompt's own, as vLLM echoes them
            sampling = dataclasses.replace(sampling, prompt_logprobs=body.logprobs)
        base = uuid.uuid4().hex
        out = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) and not all(_U32[0] <= t <= _U32[1] for t in prompt):
                raise APIError(400, "prompt: token ids must be in [0, 2^32)", "prompt")
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
            req = GenerationRequest(request_id=f"cmpl-{base}-{i}", prompt=text,
                                    prompt_token_ids=ids, sampling=sampling,
                                    priority=body.priority, stream=body.stream)
            out.append(self._validate(req, chat=False, fill_max_tokens=False,
                                      constraint_param=constraint_param))
        return out, prompts

    def _prompt_text(self, v: ValidatedRequest) -> str:
        return self.tokenizer.decode(list(v.prompt_token_ids), skip_special_tokens=False)

    def _completion_logprobs(self, logprobs, offset: int, prompt_ids=None) -> dict:
        """OpenAI completion logprobs of ``logprobs`` (generated tokens'), after the
        prompt's when ``prompt_ids`` is given (echo: the prompt's own entries, None
        for the first token, which nothing precedes)."""
        entries = []
        if prompt_ids is not None:
            entries = [(t, None, None) if lp is None else (t, lp.logprob, lp.top)
                       for t, lp in zip(prompt_ids, logprobs[0])]
            logprobs = logprobs[1]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in logprobs]
        tokens = [self._token_str(t) for t, _, _ in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [None if top is None else {self._token_str(t): v for t, v in top}
                                 for _, _, top in entries],
                "text_offset": offsets}

    async def _completions(self, body: CompletionRequest, request):
        requests, _ = self._completion_requests(body)
        self._check_serving()
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n
        held = await self._admit(request, rid)
        if body.stream:
            return self._sse(self._completion_stream(body, requests, request, rid, created),
                             on_close=held and held.release)
        try:
            finals = await self._collect(requests, request)
        finally:
            if held is not None:
                held.release()
        choices, usage = [], _Usage()
        for i, v in enumerate(requests):
            prompt_text = self._prompt_text(v) if body.echo else ""
            usage.add_prompt(len(v.prompt_token_ids))
            for j in range(n):
                s = finals[(i, j)]
                usage.add_sample(s, i)
                text = prompt_text + "".join(s.pieces)
                lps = None
                if body.logprobs is not None and body.echo:
                    lps = self._completion_logprobs((s.prompt_logprobs, s.logprobs), 0,
                                                    list(v.prompt_token_ids))
                elif body.logprobs is not None:
                    lps = self._completion_logprobs(s.logprobs, 0)
                choices.append({"index": i * n + j, "text": text, "logprobs": lps,
                                "finish_reason": s.finish_reason,
                                "stop_reason": _stop_reason(s)})
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    async def _completion_stream(self, body, requests, request, rid, created):
        n = body.n
        base = {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name}
        usage = _Usage()
        for v in requests:
            usage.add_prompt(len(v.prompt_token_ids))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        offsets: dict[int, int] = {}
        scored_echo = body.echo and body.logprobs is not None
        if body.echo and not scored_echo:
            for i, v in enumerate(requests):
                text = self._prompt_text(v)
                for j in range(n):
                    yield {**base, "choices": [{"index": i * n + j, "text": text,
                                                "logprobs": None, "finish_reason": None}]}
        async with self._running(requests) as events:
            async for i, ev in events:
                # The update, not the sample: _running queues events, so the sample
                # may have run ahead (finished) by the time an earlier event is read.
                s, upd = ev.sample, ev.update
                finished = upd.finish_reason is not None
                idx = i * n + s.index
                _check_failed(upd)
                if scored_echo and upd.prompt_logprobs is not None:
                    # The prompt's scores come with the sample's first tokens: echo it now.
                    ids = list(requests[i].prompt_token_ids)
                    lps = self._completion_logprobs((upd.prompt_logprobs, ()), 0, ids)
                    offsets[idx] = sum(len(t) for t in lps["tokens"])
                    yield {**base, "choices": [{"index": idx,
                                                "text": self._prompt_text(requests[i]),
                                                "logprobs": lps, "finish_reason": None}]}
                if not (upd.text or upd.token_ids or finished):
                    continue
                lps = None
                if body.logprobs is not None:
                    lps = self._completion_logprobs(upd.logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps["tokens"])
                choice = {"index": idx, "text": upd.text, "logprobs": lps,
                          "finish_reason": upd.finish_reason}
                if finished:
                    choice["stop_reason"] = _stop_reason(upd)
                    usage.add_sample(s, i)
                chunk = {**base, "choices": [choice]}
                if include_usage and continuous:
                    chunk["usage"] = usage.body()
                yield chunk
        if include_usage:
            yield {**base, "choices": [], "usage": usage.body()}
