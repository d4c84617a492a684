"""Turns a :class:`~tandem.router.generation_request.GenerationRequest` into
validated engine inputs, or refuses it.

Every refusal is an :class:`InvalidRequestError` whose ``field`` is the path of
the offending value in the public gRPC API's ``tandem.v1.GenerateRequest``
(``sampling.top_p``, ``token_ids.ids[3]``, ``chat.messages[0].role``): the gRPC
front end sends it as is (``INVALID_ARGUMENT``), the HTTP one maps it to the
OpenAI field name (:func:`tandem.router.openai_protocol._param_name`), and both
count the refusal in ``tandem:invalid_requests`` under its first part. Range
checks of sampling parameters are
:class:`~tandem.engine.sampling.sampling_params.SamplingParams`'s own; this module adds
what needs the request, the tokenizer or the model (presence, vocabulary and
context length, limits on sizes).

Text needs no UTF-8 check here: the gRPC front end's protobuf refuses to parse a
string field holding invalid UTF-8 (``INVALID_ARGUMENT`` ``request: ...``) and the
HTTP front end refuses lone surrogates in its request schema, naming the field,
so every ``str`` of a request is valid Unicode.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass

from tandem.engine.sampling.sampling_params import (InvalidParameterError, SamplingParams,
                                                    StructuredOutputsParams)
from tandem.engine.text.tokenizer import Tokenizer
from tandem.router.generation_request import GenerationRequest

MAX_REQUEST_ID_CHARS = 256
# Samples per request: each holds its own KV blocks and output state.
MAX_N = 128
# The stop-string matcher checks every tail shorter than the longest stop
# string after each delta, so both the count and the length are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# Text is tokenized before the context length can be checked: bound the work first.
MAX_PROMPT_BYTES = 1 << 20
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
# Fields None when not sent: absent means SamplingParams' default.
_OPTIONAL_FIELDS = ("n", "max_tokens", "temperature", "top_k", "top_p",
                    "repetition_penalty", "seed", "logprobs", "prompt_logprobs",
                    "length_penalty")
_PLAIN_FIELDS = ("min_p", "presence_penalty", "frequency_penalty",
                 "include_stop_str_in_output", "ignore_eos", "min_tokens", "use_beam_search")
# A request's input -> its field in the gRPC API (the paths refusals name).
_INPUT_FIELDS = {"prompt": "prompt", "prompt_token_ids": "token_ids", "messages": "chat"}
_DEFAULT_MAX_TOKENS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}["max_tokens"]
# The gRPC API's `constraint` oneof field -> StructuredOutputsParams' field.
CONSTRAINT_FIELDS = {"json_schema": "json", "regex": "regex", "choice": "choice",
                     "grammar": "grammar", "json_object": "json_object"}
_CONSTRAINT_PROTO_NAMES = {v: k for k, v in CONSTRAINT_FIELDS.items()}


def constraint_field_path(engine_field: str) -> str | None:
    """The proto path (``sampling.json_schema``) of an engine's structured-outputs
    field (``structured_outputs.json``); None for any other field."""
    head, _, kind = engine_field.partition(".")
    if head != "structured_outputs":
        return None
    return f"sampling.{_CONSTRAINT_PROTO_NAMES.get(kind, 'constraint')}"


class InvalidRequestError(ValueError):
    """A request is refused; ``field`` is the gRPC API's field path, ``message`` says why.

    ``str(error)`` is ``"<field>: <message>"``.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ValidatedRequest:
    """What the router hands on for one accepted ``Generate`` call.

    Attributes:
        request_id: the client's id, or a fresh 32-hex-digit one.
        prompt_token_ids: the prompt (chat template applied for chat input);
            non-empty, every id below the vocabulary size, and shorter than
            ``max_model_len``.
        sampling_params: validated; ``max_tokens`` always leaves the prompt and
            the output within ``max_model_len``.
        priority: lower is more important.
        stream: stream text deltas rather than one final message.
        skip_special_tokens: leave special tokens out of the output text.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    priority: int
    stream: bool
    skip_special_tokens: bool = True


class RequestValidator:
    """Checks :class:`GenerationRequest` s against one model's tokenizer and context.

    Args:
        tokenizer: the served model's tokenizer; prompt ids must be below its
            ``vocab_size``.
        max_model_len: longest sequence (prompt + generated tokens), in tokens.

    Raises:
        ValueError: ``max_model_len`` < 2 (no room for a prompt and a token).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        if max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.vocab_size
        # Added tokens (<|im_start|>, <|im_end|>, ...) written inside chat text
        # would be tokenized as the real control tokens and could forge turns.
        added = getattr(tokenizer.hf_tokenizer, "added_tokens_decoder", {}) or {}
        contents = sorted({str(t) for t in added.values() if str(t)}, key=len, reverse=True)
        self._control_tokens = re.compile("|".join(map(re.escape, contents))) if contents else None

    def validate(self, request: GenerationRequest,
                 fill_max_tokens: bool = False) -> ValidatedRequest:
        """Validate ``request`` and tokenize its input.

        Args:
            fill_max_tokens: an unset ``max_tokens`` becomes all the room the
                context leaves after the prompt (OpenAI chat completions' default)
                rather than the default of 16.

        Returns:
            The engine-ready request.

        Raises:
            InvalidRequestError: the first problem found, naming its field. Checks
                run cheapest first: request id, input presence, sampling
                parameters, then tokenization and lengths.
        """
        request_id = self._request_id(request.request_id)
        kind = request.input_kind
        self._check_input_present(request, kind)
        sampling = request.sampling
        params = self._sampling_params(sampling)
        if params.use_beam_search and request.stream:
            raise InvalidRequestError("stream", "is not supported with use_beam_search (the "
                                                "beams are known only when the search ends)")
        prompt_ids = self._tokenize(request, kind)
        params = self._fit_max_tokens(params, _INPUT_FIELDS[kind], len(prompt_ids),
                                      sampling.max_tokens is not None, fill_max_tokens)
        return ValidatedRequest(request_id, tuple(prompt_ids), params, request.priority,
                                request.stream, sampling.skip_special_tokens)

    # -- pieces, in the order validate() runs them ---------------------------------

    @staticmethod
    def _request_id(request_id: str) -> str:
        if not request_id:
            return uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                "request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, "
                              f"got {len(request_id)}")
        if not request_id.isprintable():
            # It is written to logs; a newline could forge log lines.
            raise InvalidRequestError("request_id", "must contain only printable characters")
        return request_id

    @staticmethod
    def _check_input_present(request: GenerationRequest, kind: str | None) -> None:
        if kind is None:
            raise InvalidRequestError("input", "one of prompt, token_ids or chat must be set")
        if kind == "prompt" and not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if kind == "prompt_token_ids" and not request.prompt_token_ids:
            raise InvalidRequestError("token_ids", "must contain at least one token id")
        if kind == "messages" and not request.messages:
            raise InvalidRequestError("chat.messages", "must contain at least one message")

    def _sampling_params(self, sampling) -> SamplingParams:
        if sampling.n is not None and sampling.n > MAX_N:
            raise InvalidRequestError("sampling.n", f"must be at most {MAX_N}, got {sampling.n}")
        if len(sampling.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "sampling.stop",
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop)}")
        for i, s in enumerate(sampling.stop):
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"sampling.stop[{i}]",
                    f"must be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        for i, t in enumerate(sampling.stop_token_ids):
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"sampling.stop_token_ids[{i}]",
                    f"token id {t} is not below the vocabulary size {self.vocab_size}")
        kwargs = {name: getattr(sampling, name) for name in _PLAIN_FIELDS}
        kwargs.update({name: getattr(sampling, name)
                       for name in _OPTIONAL_FIELDS if getattr(sampling, name) is not None})
        if sampling.use_beam_search and sampling.temperature is None:
            kwargs["temperature"] = 0.0     # beam search is deterministic (vLLM's default)
        kwargs["stop"] = tuple(sampling.stop)
        kwargs["stop_token_ids"] = tuple(sampling.stop_token_ids)
        try:
            kwargs["structured_outputs"] = self._constraint(sampling.constraint)
            return SamplingParams(**kwargs)
        except InvalidParameterError as e:
            path = constraint_field_path(e.field) or f"sampling.{e.field}"
            raise InvalidRequestError(path, str(e).removeprefix(f"{e.field}: ")) from None

    @staticmethod
    def _constraint(constraint) -> StructuredOutputsParams | None:
        """``constraint`` as engine parameters, parsed by the grammar backend
        (cheap: no tokenizer; the engine compiles it for its vocabulary).

        Raises:
            InvalidParameterError: ``field`` ``structured_outputs.<kind>``.
        """
        if constraint is None:
            return None
        value = constraint.value
        if constraint.kind == "choice":
            value = tuple(value)
        params = StructuredOutputsParams(**{constraint.kind: value})
        from tandem.engine.sampling.grammar import check_structured_outputs  # imports xgrammar

        check_structured_outputs(params)
        return params

    def _tokenize(self, request: GenerationRequest, kind: str) -> list[int]:
        if kind == "prompt" and len(request.prompt.encode()) > MAX_PROMPT_BYTES:
            raise InvalidRequestError("prompt", f"must be at most {MAX_PROMPT_BYTES} bytes of "
                                                f"UTF-8, got {len(request.prompt.encode())}")
        if kind == "prompt_token_ids" and len(request.prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "token_ids", f"the prompt is {len(request.prompt_token_ids)} tokens, but "
                             f"max_model_len is {self.max_model_len}: at least one token must "
                             "fit after it")
        if kind == "messages":
            size = sum(len(m.content.encode()) for m in request.messages)
            if size > MAX_PROMPT_BYTES:
                raise InvalidRequestError("chat.messages", f"the contents must be at most "
                                                           f"{MAX_PROMPT_BYTES} bytes of UTF-8 "
                                                           f"together, got {size}")
        if kind == "prompt":
            ids = self.tokenizer.encode(request.prompt)
            if not ids:
                raise InvalidRequestError("prompt", "encodes to no tokens")
            return ids
        if kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids)
            for i, t in enumerate(ids):
                if t >= self.vocab_size:
                    raise InvalidRequestError(
                        f"token_ids.ids[{i}]",
                        f"token id {t} is not below the vocabulary size {self.vocab_size}")
            return ids
        return self._apply_chat_template(request.messages)

    @staticmethod
    def check_chat_role(field: str, role: str) -> None:
        """Refuse a chat message role that is not 1-32 letters, digits, '_' or '-'
        starting with a letter.

        Raises:
            InvalidRequestError: naming ``field``.
        """
        if not _ROLE.fullmatch(role):
            raise InvalidRequestError(
                field, "must be 1-32 letters, digits, '_' or '-' starting with a letter "
                       f"(e.g. 'user'), got {role!r}")

    def check_chat_text(self, field: str, text: str) -> None:
        """Refuse text bound for a chat template that holds one of the tokenizer's added
        tokens (``<|im_end|>``): tokenized as the real control token it could forge turns.

        Raises:
            InvalidRequestError: naming ``field``.
        """
        found = self._control_tokens.search(text) if self._control_tokens else None
        if found:
            raise InvalidRequestError(
                field, f"must not contain the control token {found.group()!r} "
                       "(send a token_ids or prompt request to write control tokens)")

    def _apply_chat_template(self, messages) -> list[int]:
        from jinja2 import TemplateError  # comes with transformers' chat templates

        for i, m in enumerate(messages):
            self.check_chat_role(f"chat.messages[{i}].role", m.role)
            self.check_chat_text(f"chat.messages[{i}].content", m.content)
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(conversation)
        except TemplateError as e:  # the template refused the conversation
            raise InvalidRequestError("chat.messages",
                                      f"rejected by the chat template: {e}") from None
        except ValueError as e:
            # Tokenizer errors are "messages...: why"; anchor them under chat.
            field, _, message = str(e).partition(": ")
            raise InvalidRequestError(f"chat.{field}", message) from None

    def _fit_max_tokens(self, params: SamplingParams, kind: str, num_prompt_tokens: int,
                        max_tokens_set: bool, fill: bool = False) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                kind, f"the prompt is {num_prompt_tokens} tokens, but max_model_len is "
                      f"{self.max_model_len}: at least one token must fit after it")
        if max_tokens_set:
            if params.max_tokens > room:
                raise InvalidRequestError(
                    "sampling.max_tokens",
                    f"prompt tokens ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) = "
                    f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len "
                    f"({self.max_model_len})")
            return params
        if params.max_tokens <= room and not fill:
            return params
        # An unset max_tokens shrinks to the room left rather than failing.
        try:
            return dataclasses.replace(params, max_tokens=room if fill else
                                       min(_DEFAULT_MAX_TOKENS, room))
        except InvalidParameterError as e:  # min_tokens no longer fits
            raise InvalidRequestError(f"sampling.{e.field}",
                                      str(e).removeprefix(f"{e.field}: ")) from None
