"""The request side of tool calling on ``/v1/chat/completions``: checking ``tools`` and
``tool_choice``, the grammar that forces a tool choice, and the conversation handed to
the chat template.

Field names, defaults and rules follow vLLM's ``ChatCompletionRequest`` (and OpenAI's
API): ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given and to ``"none"``
otherwise; any other ``tool_choice`` needs ``tools``; a named choice must name one of
them. A forced choice is a JSON-schema constraint on the output (vLLM's
``_get_json_schema_from_tool``):

- named function: the function's ``parameters`` schema (the output *is* the
  arguments object);
- ``"required"``: an array of at least one ``{"name": <enum of one tool>,
  "parameters": <its schema>}``, ``anyOf`` over the tools; ``maxItems: 1`` when
  ``parallel_tool_calls`` is false.

Every refusal is a :class:`ToolRequestError` naming the request field.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.router.tool_parsers import (JsonArrayToolParser, NamedToolParser, ToolParser,
                                        get_tool_parser)

MAX_TOOLS = 128
"""Tools per request."""
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """Bad tool-calling input; ``param`` is the request field (``tools[0].function``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        tools: the checked ``tools`` (for the chat template); empty when none.
        schema: the JSON schema that forces a ``required`` / ``named`` choice, else None.
        parser: reads tool calls out of the output (None for ``none``, and for
            ``auto`` without a server-side parser: the output is content).
        max_calls: 1 when ``parallel_tool_calls`` is false, else None.
    """

    mode: str
    tools: tuple[dict, ...]
    schema: dict | None
    parser: ToolParser | None
    max_calls: int | None


def check_tools(tools: list[Any] | None) -> tuple[dict, ...]:
    """``tools`` as the chat template and the grammar take them.

    Each must be ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}``: a name of 1-64 letters, digits, ``_`` or ``-``,
    unique; ``parameters`` a JSON-schema object (its compile is checked only when a
    forced tool choice needs it).

    Raises:
        ToolRequestError: ``param`` ``tools``, naming the element in the message.
    """
    if not tools:
        return ()
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolRequestError("tools", f"{where}: must be an object with type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolRequestError("tools", f"{where}.function: an object is required")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError("tools", f"{where}.function.name: must be 1-64 letters, "
                                            f"digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ToolRequestError("tools", f"{where}.function.name: {name!r} is given twice")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], (str, type(None))):
            raise ToolRequestError("tools", f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolRequestError("tools", f"{where}.function.parameters: must be a JSON "
                                            "schema object")
        out.append({"type": "function", "function": fn})
    return tuple(out)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               auto_parser: str | None) -> ToolPlan:
    """Check the request's tool fields and decide how it is served.

    Args:
        tools, tool_choice, parallel_tool_calls: the request's fields (None = unset).
        auto_parser: the server's ``--tool-call-parser`` when
            ``--enable-auto-tool-choice`` is on, else None.

    Raises:
        ToolRequestError: ``tools`` malformed; ``tool_choice`` not one of ``none``,
            ``auto``, ``required`` or ``{"type": "function", "function": {"name"}}``,
            given without ``tools``, naming a function not in ``tools``, or ``auto``
            on a server without an auto tool parser.
    """
    checked = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    max_calls = 1 if parallel_tool_calls is False else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                                  "{'type': 'function', 'function': {'name': "
                                                  f"...}}}}, got {tool_choice!r}")
        if tool_choice == "none":
            return ToolPlan("none", checked, None, None, max_calls)
        if not checked:
            raise ToolRequestError("tool_choice", f"{tool_choice!r} needs tools: `tools` "
                                                  "must be set")
        if tool_choice == "auto":
            if auto_parser is None:
                raise ToolRequestError("tool_choice", "'auto' tool choice requires the server "
                                                      "to run with --enable-auto-tool-choice "
                                                      "and --tool-call-parser")
            return ToolPlan("auto", checked, None, get_tool_parser(auto_parser), max_calls)
        return ToolPlan("required", checked, required_schema(checked, max_calls),
                        JsonArrayToolParser(), max_calls)
    if not isinstance(tool_choice, dict):
        raise ToolRequestError("tool_choice", "must be a string or an object")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ToolRequestError("tool_choice", "a named tool choice is {'type': 'function', "
                                              "'function': {'name': ...}}")
    if not checked:
        raise ToolRequestError("tool_choice", "a named tool choice needs tools: `tools` "
                                              "must be set")
    tool = next((t for t in checked if t["function"]["name"] == name), None)
    if tool is None:
        raise ToolRequestError("tool_choice", f"function {name!r} is not among the tools")
    schema = tool["function"].get("parameters") or _EMPTY_PARAMETERS
    return ToolPlan("named", checked, schema, NamedToolParser(name), 1)


def required_schema(tools: tuple[dict, ...], max_calls: int | None) -> dict:
    """The JSON schema of ``tool_choice="required"`` output (vLLM's): an array of
    ``{"name", "parameters"}`` objects, ``anyOf`` over ``tools``."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or _EMPTY_PARAMETERS},
              "required": ["name", "parameters"]}
             for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def template_message(role: str, content: str, tool_calls: list[Any] | None,
                     tool_call_id: str | None, name: str | None, i: int) -> dict:
    """One message as the chat template gets it: ``role``, ``content`` (a string:
    ``""`` for an assistant turn that only calls tools), and ``tool_calls`` whose
    ``function.arguments`` are parsed into objects (what Hermes / Qwen / Llama 3
    templates render with ``tojson``, as vLLM passes them), ``tool_call_id``, ``name``.

    Raises:
        ToolRequestError: ``param`` ``messages[i].tool_calls[j]...``: a tool call that
            is not ``{"id"?, "type": "function", "function": {"name", "arguments"}}``
            with arguments a JSON object's text.
    """
    msg: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        calls = []
        for j, call in enumerate(tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolRequestError(where, "must be {'type': 'function', 'function': "
                                              "{'name': ..., 'arguments': ...}}")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as exc:
                    raise ToolRequestError(f"{where}.function.arguments",
                                           f"must be a JSON object's text: {exc}") from None
            if not isinstance(args, dict):
                raise ToolRequestError(f"{where}.function.arguments", "must be a JSON object")
            calls.append({"id": call.get("id") or f"call_{i}_{j}", "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        msg["tool_calls"] = calls
    if tool_call_id is not None:
        msg["tool_call_id"] = tool_call_id
    if name is not None:
        msg["name"] = name
    return msg


def template_tools(tools: tuple[dict, ...]) -> list[dict] | None:
    """``tools`` for ``apply_chat_template(tools=...)`` (copies: templates may not
    change the request), None when there are none."""
    return [copy.deepcopy(t) for t in tools] or None
