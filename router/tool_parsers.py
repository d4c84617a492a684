"""Tool calls read out of generated text: a parser per output format, behind a registry.

A :class:`ToolParser` reads the text a sample has produced so far and says which part
of it is ordinary content and which tool calls it holds, each call's arguments as the
exact text the model wrote (a JSON object). The same ``parse`` serves both paths:

- non-streaming, :func:`extract_tool_calls` parses the whole output once
  (``final=True``); a call that does not parse (unclosed, arguments that are not a
  JSON object, no name) leaves the whole output as content, as vLLM's parsers do;
- streaming, a :class:`ToolCallStream` per sample re-parses the text after every
  delta (``final=False``) and sends what grew: content, then per call a first delta
  with ``index``, ``id``, ``type`` and ``function.name``, then fragments of
  ``function.arguments`` (OpenAI's and vLLM's chunk shapes). Partial results only
  ever grow, so nothing sent needs taking back: content that might be the start of
  a tool-call marker is held back until the next delta decides it.

Registered formats (``--tool-call-parser``, vLLM's names):

========= ==============================================================================
hermes    Hermes 2 Pro / Qwen 2.5 / Qwen 3: ``<tool_call>{"name": ..., "arguments":
          {...}}</tool_call>``, one block per call; text before the first block is
          content.
llama3_json Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``
          (``"arguments"`` accepted too), several separated by ``;``, at the start of
          the output or after ``<|python_tag|>`` (text before the tag is content).
========= ==============================================================================

Two more parsers read what the grammar of a forced tool choice generates (see
:mod:`tandem.router.tool_calling`): :class:`NamedToolParser` (the output is the named
function's arguments) and :class:`JsonArrayToolParser` (``tool_choice="required"``:
a JSON array of ``{"name", "parameters"}``).

Calls are located in growing text by :mod:`tandem.router.partial_json`; whether a
finished call is valid JSON is left to :func:`json.loads`.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field

from tandem.router.partial_json import MalformedToolCall, scan_object, skip_ws, value_end

__all__ = ["ToolCall", "PartialCall", "ParsedOutput", "ToolParser", "HermesToolParser",
           "Llama3JsonToolParser", "NamedToolParser", "JsonArrayToolParser", "TOOL_PARSERS",
           "get_tool_parser", "extract_tool_calls", "ToolCallStream", "new_tool_call_id"]


def new_tool_call_id() -> str:
    """A fresh tool call id, ``call_`` + 24 hex digits (OpenAI's ``call_...`` shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One finished tool call.

    Attributes:
        name: the function's name.
        arguments: the arguments as the model wrote them: the text of a JSON object.
        id: ``call_...``.
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        """The OpenAI ``message.tool_calls[i]`` object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class PartialCall:
    """A tool call as far as the text goes.

    Attributes:
        name: None until the name's string has closed.
        arguments: the arguments' text so far ("" until the value starts); grows only.
        complete: the call's text has ended (its object closed).
    """

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedOutput:
    """What a parser read: ``content`` (text outside tool calls; only grows while the
    output does) and the ``calls`` in the order they appear."""

    content: str
    calls: tuple[PartialCall, ...] = ()


def _scan_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call whose object starts at ``text[i]``, and the index after it (None: open)."""
    if text[i] != "{":
        raise MalformedToolCall(f"a tool call is a JSON object, got {text[i]!r}")
    members, end = scan_object(text, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        value = json.loads(text[start:stop]) if text[start] == '"' else None
        if not isinstance(value, str):
            raise MalformedToolCall("the tool call's name is not a string")
        name = value
    arguments = ""
    key = next((k for k in args_keys if k in members), None)
    if key is not None:
        start, stop = members[key]
        arguments = text[start:stop]
    return PartialCall(name, arguments, end is not None), end


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# -- parsers ---------------------------------------------------------------------------

class ToolParser(abc.ABC):
    """Reads one output format. Stateless: a parser may serve many samples at once."""

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and tool calls of ``text`` (a sample's output so far).

        Args:
            final: the output is complete; without it, content that may still turn
                out to start a tool call is held back.

        Raises:
            MalformedToolCall: the text has a tool-call marker whose call cannot parse.
        """


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro,
    Qwen 2.5 / 3 chat templates); the text before the first block is content, text
    between and after blocks is dropped (as vLLM's ``hermes`` parser does). An unclosed
    last block at the end of the output counts if its object is complete."""

    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.START)
            return ParsedOutput(text[:keep])
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            j = skip_ws(text, pos + len(self.START))
            if j >= len(text):
                break
            call, end = _scan_call(text, j, ("arguments", "parameters"))
            calls.append(call)
            if end is None:
                break
            pos = text.find(self.START, end)
        return ParsedOutput(text[:first], tuple(calls))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}`` objects
    separated by ``;`` that start the output (after whitespace) or follow the
    ``<|python_tag|>`` token (the text before it is content; the tag survives
    detokenization only where it is not a special token or ``skip_special_tokens``
    is false). Output that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        tag = text.find(self.TAG)
        lead = skip_ws(text, 0)
        if lead < len(text) and text[lead] == "{":
            content, start = "", lead
        elif tag >= 0:
            content, start = text[:tag], tag + len(self.TAG)
        elif final:
            return ParsedOutput(text)
        else:
            # Whitespace alone may still precede a call; hold back a partial tag.
            if lead >= len(text):
                return ParsedOutput("")
            return ParsedOutput(text[:len(text) - _held_back(text, self.TAG)])
        calls: list[PartialCall] = []
        j = skip_ws(text, start)
        while j < len(text):
            call, end = _scan_call(text, j, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            elif j < len(text):
                raise MalformedToolCall(f"expected ';' between tool calls, got {text[j]!r}")
        return ParsedOutput(content, tuple(calls))


class NamedToolParser(ToolParser):
    """The output of ``tool_choice={"type": "function", "function": {"name": ...}}``:
    the grammar makes the whole output the function's arguments object."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        j = skip_ws(text, 0)
        if j >= len(text):
            return ParsedOutput("", (PartialCall(self.name, "", final),))
        end = value_end(text, j)
        return ParsedOutput("", (PartialCall(self.name, text[j:end], end is not None),))


class JsonArrayToolParser(ToolParser):
    """The output of ``tool_choice="required"``: the grammar makes it a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects (vLLM's schema)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        j = skip_ws(text, 0)
        if j >= len(text):
            return ParsedOutput("")
        if text[j] != "[":
            raise MalformedToolCall(f"expected a JSON array, got {text[j]!r}")
        calls: list[PartialCall] = []
        j = skip_ws(text, j + 1)
        while j < len(text) and text[j] != "]":
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            call, end = _scan_call(text, j, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
        return ParsedOutput("", tuple(calls))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
"""``--tool-call-parser`` names (vLLM's) -> parser classes."""


def get_tool_parser(name: str) -> ToolParser:
    """The registered parser ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def _finished_calls(parsed: ParsedOutput) -> list[ToolCall] | None:
    """The calls of a final parse, or None when one is unfinished or invalid."""
    out = []
    for c in parsed.calls:
        if not c.complete or c.name is None:
            return None
        try:
            args = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        out.append(ToolCall(c.name, c.arguments or "{}"))
    return out


def extract_tool_calls(parser: ToolParser, text: str,
                       max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """Content and tool calls of a finished output.

    Args:
        max_calls: keep at most this many calls (``parallel_tool_calls=false``: 1).

    Returns:
        ``(content, calls)``: content is None when it is empty and there are calls
        (OpenAI's ``content: null``). No calls (none found, or one that does not
        parse): ``(text, [])``.
    """
    try:
        parsed = parser.parse(text, final=True)
    except MalformedToolCall:
        return text, []
    calls = _finished_calls(parsed)
    if not calls:
        return text, []
    if max_calls is not None:
        calls = calls[:max_calls]
    return parsed.content or None, calls


class ToolCallStream:
    """Turns one sample's text deltas into chat-completion deltas with tool calls.

    ``feed(delta)`` and, once the sample ends, ``finish()`` each return
    ``(content, tool_call_deltas)``: the content that became sure (possibly "") and a
    list of ``choices[i].delta.tool_calls`` entries: a call's first entry is
    ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``, later
    ones ``{"index", "function": {"arguments": fragment}}``. The fragments of a call
    concatenate to its whole arguments text, which is what the non-streaming answer
    returns for the same output. After ``finish()``, ``complete`` says whether the
    calls sent were whole and valid (the non-streaming answer would have them: the
    finish reason becomes ``tool_calls``); a call cut off by ``max_tokens`` was sent
    in part but is not complete.

    Args:
        parser: the format.
        max_calls: send at most this many calls (``parallel_tool_calls=false``: 1).
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.num_content = 0                  # characters of content sent
        self.sent: list[list] = []            # per call sent: [id, arguments sent]
        self.broken = False                   # a malformed call: nothing more is sent
        self.complete = False                 # finish() found every call whole and valid

    @property
    def called(self) -> bool:
        """At least one tool call was sent."""
        return bool(self.sent)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.broken:
            return "", []
        try:
            parsed = self.parser.parse(self.text, final=False)
        except MalformedToolCall:
            self.broken = True
            return "", []
        return self._diff(parsed)

    def finish(self) -> tuple[str, list[dict]]:
        try:
            parsed = self.parser.parse(self.text, final=True)
        except MalformedToolCall:
            parsed = None
        calls = _finished_calls(parsed) if parsed is not None else None
        self.complete = bool(calls) and not self.broken
        if not calls and not self.sent:
            # No call after all: what was held back is content.
            content = self.text[self.num_content:]
            self.num_content = len(self.text)
            return content, []
        if self.broken or parsed is None:
            return "", []
        return self._diff(parsed)

    def _diff(self, parsed: ParsedOutput) -> tuple[str, list[dict]]:
        content = ""
        if not self.sent and len(parsed.content) > self.num_content:
            content = parsed.content[self.num_content:]
            self.num_content = len(parsed.content)
        deltas: list[dict] = []
        limit = len(parsed.calls) if self.max_calls is None else \
            min(self.max_calls, len(parsed.calls))
        for i in range(limit):
            call = parsed.calls[i]
            if i >= len(self.sent):
                if call.name is None:
                    break                     # later calls wait for this one's name
                call_id = new_tool_call_id()
                self.sent.append([call_id, len(call.arguments)])
                deltas.append({"index": i, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            num_sent = self.sent[i][1]
            if len(call.arguments) > num_sent:
                deltas.append({"index": i,
                               "function": {"arguments": call.arguments[num_sent:]}})
                self.sent[i][1] = len(call.arguments)
        return content, deltas
