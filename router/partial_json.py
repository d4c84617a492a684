"""An incremental reader of JSON text that may still be growing, for tool-call parsers.

It finds the top-level members of an object and where each value ends, or says the
text ends inside it (None), without parsing values: a streamed tool call's name and
arguments are known as spans of the text so far. Structure only; whether a finished
value is valid JSON is left to :func:`json.loads`. Each call is linear in the text it
reads, jumping between quotes and brackets with ``str.find`` and a regex.
"""

from __future__ import annotations

import json
import re

__all__ = ["MalformedToolCall", "skip_ws", "string_end", "value_end", "scan_object"]


class MalformedToolCall(ValueError):
    """The text cannot be (the start of) a tool call: not JSON syntax where JSON must be."""


_STRUCTURAL = re.compile(r'["{}\[\]]')
_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i`` (``len(text)``
    if none)."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """``text[i]`` is ``"``: the index after the closing quote, None if not closed yet."""
    j = i + 1
    while True:
        q = text.find('"', j)
        if q < 0:
            return None
        k = q - 1                    # an odd number of backslashes escapes the quote
        while text[k] == "\\":
            k -= 1
        if (q - 1 - k) % 2 == 0:
            return q + 1
        j = q + 1


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]`` (not whitespace), None if
    the text ends inside it (a number or literal at the very end may still grow)."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCTURAL.search(text, j)
            if m is None:
                return None
            j = m.start()
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            j += 1
            if depth == 0:
                return j
    if c in "}],:":
        raise MalformedToolCall(f"a value cannot start with {c!r}")
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Top-level members of the object starting at ``text[i] == "{"``.

    Returns:
        ``({key: (value start, value end or None)}, end)``: ``end`` is the index after
        the closing brace, None while the text ends inside the object (then the last
        member may be unfinished).

    Raises:
        MalformedToolCall: not an object's syntax.
    """
    members: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            return members, None
        c = text[j]
        if c == "}":
            return members, j + 1
        if c == ",":
            j = skip_ws(text, j + 1)
            continue
        if c != '"':
            raise MalformedToolCall(f"expected a key, got {c!r}")
        key_end = string_end(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise MalformedToolCall(f"expected ':' after a key, got {text[j]!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end = value_end(text, j)
        members[key] = (j, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
