"""The front ends' common form of one generate call, before validation.

Each front end converts its wire format into a :class:`GenerationRequest`: the
gRPC one from a ``tandem.v1.GenerateRequest`` (:func:`tandem.router.server.request_from_proto`),
the HTTP one from its OpenAI request models (:mod:`tandem.router.openai_completions`,
:mod:`tandem.router.openai_chat`). :class:`~tandem.router.validation.RequestValidator`
turns it into a :class:`~tandem.router.validation.ValidatedRequest` or refuses it,
so both front ends accept and refuse exactly the same inputs::

    gRPC GenerateRequest ─┐                    RequestValidator
                          ├─> GenerationRequest ──────────────> ValidatedRequest ─> Orchestrator
    OpenAI HTTP body ─────┘

Values are taken as sent, unchecked (checking is the validator's). Numbers have
the gRPC API's ranges: counts and token ids are unsigned 32-bit, ``top_k`` and
``priority`` signed 32-bit, ``seed`` unsigned 64-bit, floats single precision;
the HTTP front end refuses values outside them and rounds floats as the gRPC
wire does, so a request means the same through either front end.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation for the chat template."""

    role: str
    content: str = ""


@dataclass(frozen=True)
class Constraint:
    """A structured-outputs constraint as sent, not yet parsed.

    Attributes:
        kind: the :class:`~tandem.engine.sampling.sampling_params.StructuredOutputsParams`
            field it sets: ``json`` (a JSON schema as JSON text), ``regex``, ``choice``,
            ``grammar`` or ``json_object``.
        value: its value (``choice``: a tuple of strings; ``json_object``: True).
    """

    kind: str
    value: str | bool | tuple[str, ...]


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields of a request as the client sent them; a field left None
    was not sent and takes :class:`~tandem.engine.sampling.sampling_params.SamplingParams`'
    default (``max_tokens`` the room the context leaves, up to 16).

    Field meanings are SamplingParams' (vLLM's); ``skip_special_tokens`` leaves
    special tokens out of the output text; ``constraint`` becomes its
    ``structured_outputs``.
    """

    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One generate call as a front end received it.

    At most one input is set: ``prompt`` (raw text, tokenized as is),
    ``prompt_token_ids`` (a tokenized prompt) or ``messages`` (a conversation for
    the chat template); none set is the client's error, which the validator reports.

    Attributes:
        request_id: the client's id; empty: the validator assigns one.
        prompt: raw text.
        prompt_token_ids: token ids.
        messages: chat turns.
        sampling: the sampling fields.
        priority: lower is served first and preempted last.
        stream: stream text deltas rather than one final message per sample.

    Raises:
        ValueError: more than one input is set (a front end's bug, not the client's).
    """

    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingFields = field(default_factory=SamplingFields)
    priority: int = 0
    stream: bool = False

    def __post_init__(self) -> None:
        inputs = [f for f in ("prompt", "prompt_token_ids", "messages")
                  if getattr(self, f) is not None]
        if len(inputs) > 1:
            raise ValueError(f"at most one input may be set, got {' and '.join(inputs)}")

    @property
    def input_kind(self) -> str | None:
        """Which input is set: ``prompt``, ``prompt_token_ids``, ``messages``, or None."""
        return next((f for f in ("prompt", "prompt_token_ids", "messages")
                     if getattr(self, f) is not None), None)
