"""``POST /v1/chat/completions`` of the OpenAI-compatible front end (tools included:
:mod:`tandem.router.tool_calling`, :mod:`tandem.router.tool_parsers`)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from tandem.router.generation_request import ChatMessage as Turn
from tandem.router.generation_request import Constraint, GenerationRequest
from tandem.router.openai_protocol import (APIError, ChatCompletionRequest, ChatMessage, _Usage,
                                           _check_failed, _check_size, _message_text,
                                           _refuse_unsupported, _sampling_fields, _stop_reason)
from tandem.router.tool_calling import (ToolPlan, ToolRequestError, plan_tools, template_message,
                                        template_tools)
from tandem.router.tool_parsers import ToolCallStream, extract_tool_calls
from tandem.router.validation import InvalidRequestError, ValidatedRequest


class ChatServing:
    """``POST /v1/chat/completions``: a conversation (and its tools) rendered with the
    model's chat template and validated as one request; streamed or whole. A mixin of
    :class:`~tandem.router.openai_api.OpenAIServer`, whose shared state and helpers
    (``_validate``, ``_running``, ``_collect``, ``_sse``, ``_token_str``) it uses."""

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": m.role, "content": _message_text(m, i)}
                        for i, m in enumerate(messages)]
        _check_size("messages", sum(len(m["content"].encode()) for m in conversation))
        return self._render(conversation, add_generation_prompt)

    def _render(self, conversation: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``conversation`` under the chat template (``tools`` passed to
        it); a refusal by the template or the tokenizer is a 400 naming the message."""
        from jinja2 import TemplateError  # comes with transformers' chat templates

        try:
            if tools is None:
                return self.tokenizer.apply_chat_template(conversation, add_generation_prompt)
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt,
                                                      tools=tools)
        except TemplateError as exc:       # the template refused the conversation
            raise APIError(400, f"messages: rejected by the chat template: {exc}",
                           "messages") from None
        except ValueError as exc:          # "messages...: why"
            param, _, message = str(exc).partition(": ")
            raise APIError(400, f"{param}: {message}", param) from None

    def _tool_chat_ids(self, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """The prompt of a chat request with tools or tool turns: the conversation and
        the tools through the chat template, with the checks the validator makes of
        chat text (roles, no control tokens) applied to every string it renders.

        Raises:
            APIError: 400 naming the field (``messages[1].tool_calls[0].function.arguments``,
                ``tools``).
        """
        v = self.validator
        tools = template_tools(plan.tools)
        tools_text = json.dumps(tools, ensure_ascii=False) if tools else ""
        conversation, size = [], len(tools_text.encode())
        try:
            if tools:
                v.check_chat_text("tools", tools_text)
            for i, m in enumerate(body.messages):
                text = _message_text(m, i)
                v.check_chat_role(f"messages[{i}].role", m.role)
                v.check_chat_text(f"messages[{i}].content", text)
                for name in ("tool_call_id", "name"):
                    if getattr(m, name):
                        v.check_chat_text(f"messages[{i}].{name}", getattr(m, name))
                if m.tool_calls:
                    calls_text = json.dumps(m.tool_calls, ensure_ascii=False)
                    v.check_chat_text(f"messages[{i}].tool_calls", calls_text)
                    size += len(calls_text.encode())
                size += len(text.encode())
                conversation.append(template_message(m.role, text, m.tool_calls,
                                                     m.tool_call_id, m.name, i))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None
        _check_size("messages", size)
        return self._render(conversation, body.add_generation_prompt, tools)

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        try:
            return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                              self.tool_call_parser)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def _chat_request(self, body: ChatCompletionRequest,
                      plan: ToolPlan | None = None) -> ValidatedRequest:
        self._check_model(body.model)
        _refuse_unsupported(body)
        plan = plan or self._tool_plan(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs to be true", "top_logprobs")
        if not body.messages:
            raise APIError(400, "messages: must contain at least one message", "messages")
        uses_completion = body.max_completion_tokens is not None
        max_tokens = body.max_completion_tokens if uses_completion else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            sampling, constraint_param = _sampling_fields(body, max_tokens, logprobs)
        except APIError as exc:
            if exc.param == "logprobs":
                exc.param, exc.message = "top_logprobs", exc.message.replace("logprobs", "top_logprobs", 1)
            if exc.param == "max_tokens" and uses_completion:
                exc.param = "max_completion_tokens"
            raise
        if plan.schema is not None:
            # A forced tool choice is a JSON-schema constraint (vLLM's).
            if constraint_param is not None:
                raise APIError(400, f"tool_choice: {plan.mode!r} cannot be combined with "
                                    f"{constraint_param}", "tool_choice")
            schema = json.dumps(plan.schema, ensure_ascii=False)
            sampling = dataclasses.replace(sampling, constraint=Constraint("json", schema))
            constraint_param = "tools"
        ids = messages = None
        if plan.tools or any(m.tool_calls or m.tool_call_id is not None for m in body.messages):
            # Tools and tool turns reach the template only here (the validator's chat
            # turns have role and content): the prompt goes on as token ids.
            ids = tuple(self._tool_chat_ids(body, plan))
        else:
            messages = tuple(Turn(m.role, _message_text(m, i)) for i, m in enumerate(body.messages))
        req = GenerationRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", prompt_token_ids=ids,
                                messages=messages, sampling=sampling, priority=body.priority,
                                stream=body.stream)
        return self._validate(req, chat=True, fill_max_tokens=max_tokens is None,
                              completion_tokens=uses_completion,
                              constraint_param=constraint_param)

    def _chat_logprobs(self, logprobs) -> dict:
        def entry(token_id: int, lp: float) -> dict:
            t = self._token_str(token_id)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    async def _chat(self, body: ChatCompletionRequest, request):
        self._check_model(body.model)          # an unknown model first: 404 before any 400
        plan = self._tool_plan(body)
        v = self._chat_request(body, plan)
        self._check_serving()
        rid, created = v.request_id, int(time.time())
        held = await self._admit(request, rid)
        if body.stream:
            return self._sse(self._chat_stream(body, v, request, rid, created, plan),
                             on_close=held and held.release)
        try:
            finals = await self._collect([v], request)
        finally:
            if held is not None:
                held.release()
        usage = _Usage()
        usage.add_prompt(len(v.prompt_token_ids))
        choices = []
        for j in range(body.n):
            s = finals[(0, j)]
            usage.add_sample(s)
            message, finish_reason = _chat_message("".join(s.pieces), s.finish_reason, plan)
            choices.append({"index": j, "message": message,
                            "logprobs": self._chat_logprobs(s.logprobs) if body.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": _stop_reason(s)})
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    async def _chat_stream(self, body, v, request, rid, created, plan: ToolPlan | None = None):
        # Per sample: reads tool calls out of its deltas (None: plain content).
        tool_streams = {j: ToolCallStream(plan.parser, plan.max_calls) for j in range(body.n)} \
            if plan is not None and plan.parser is not None else {}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        usage = _Usage()
        usage.add_prompt(len(v.prompt_token_ids))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        # The role chunks go out with the first output, as vLLM sends them: clients take
        # the first chunk's arrival as TTFT (`vllm bench serve` does), so sent before
        # the prefill they would report a TTFT of ~0 and fold the prefill into TPOT.
        # A request that fails first gets its error frame first.
        role_sent = False

        def role_chunks():
            return [{**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
                    for j in range(body.n)]

        async with self._running([v]) as events:
            async for _, ev in events:
                s, upd = ev.sample, ev.update       # the update: see _completion_stream
                finished = upd.finish_reason is not None
                _check_failed(upd)
                if not (upd.text or upd.token_ids or finished):
                    continue
                if not role_sent:
                    role_sent = True
                    for chunk in role_chunks():
                        yield chunk
                finish_reason = upd.finish_reason
                if tool_streams:
                    delta, finish_reason = _tool_delta(tool_streams[s.index], upd.text,
                                                       finish_reason)
                    if not (delta or finished or body.logprobs):
                        continue               # held back: may start a tool call
                else:
                    delta = {"content": upd.text} if upd.text or not finished else {}
                choice = {"index": s.index, "delta": delta,
                          "logprobs": self._chat_logprobs(upd.logprobs) if body.logprobs else None,
                          "finish_reason": finish_reason}
                if finished:
                    choice["stop_reason"] = _stop_reason(upd)
                    usage.add_sample(s)
                chunk = {**base, "choices": [choice]}
                if include_usage and continuous:
                    chunk["usage"] = usage.body()
                yield chunk
        if include_usage:
            yield {**base, "choices": [], "usage": usage.body()}


def _chat_message(text: str, finish_reason: str | None,
                  plan: ToolPlan) -> tuple[dict, str | None]:
    """A finished sample's ``message`` and ``finish_reason``: with tool calls found in
    ``text`` (``plan``'s parser), ``content`` is the text before them (None if none),
    ``tool_calls`` the calls and the finish reason ``tool_calls``."""
    if plan.parser is not None:
        content, calls = extract_tool_calls(plan.parser, text, plan.max_calls)
        if calls:
            return ({"role": "assistant", "content": content,
                     "tool_calls": [c.to_openai() for c in calls]}, "tool_calls")
    return {"role": "assistant", "content": text}, finish_reason


def _tool_delta(stream: ToolCallStream, text: str,
                finish_reason: str | None) -> tuple[dict, str | None]:
    """A chunk's ``delta`` and ``finish_reason`` for ``text`` (a sample's new text) read
    by its :class:`ToolCallStream`; ``finish_reason`` not None: the sample ended."""
    content, calls = stream.feed(text) if text else ("", [])
    if finish_reason is not None:
        more, more_calls = stream.finish()
        content, calls = content + more, calls + more_calls
        if stream.complete:               # as the non-streaming answer decides it
            finish_reason = "tool_calls"
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta, finish_reason
