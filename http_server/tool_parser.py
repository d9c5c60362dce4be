"""`--tool-call-parser`: the tool calls a model writes in its chat output, as OpenAI's
`tool_calls`, streamed or whole.

qwen25 (Hermes style, Qwen2.5 and Qwen3): each call is `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, anywhere in the text; the text around the calls stays content.
llama3 (Llama 3.1/3.2's JSON tool calling): the whole output is one call, or several joined by
`;`, each `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`.

Streamed as OpenAI streams them: a call's first delta has its index, id, type and name (as soon
as the name is whole), the next ones fragments of its arguments' JSON. A call that does not parse
is left as text, as SGLang and vLLM do.
"""

from __future__ import annotations

import json
import re
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

from radixserve.http_server.reasoning_parser import held_back
from radixserve.http_server.tool_grammar import constrained_tool_calls

TOOL_CALL_PARSERS = ("qwen25", "llama3")
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


@dataclass(slots=True)
class CallDelta:
    index: int
    arguments: str  # a fragment of the arguments' JSON text
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            body |= {"id": self.id, "type": "function"}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        return body | {"function": function}


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments' JSON) of one call's JSON text, or None when it is no call."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the JSON as a string
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class _Qwen25:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.count = 0  # calls begun
        self._start_call()

    def _start_call(self) -> None:
        self.named = False  # the current call's name went out
        self.depths = _JsonDepths()  # of the call's text in the buffer
        self.args_start: int | None = None  # where its arguments' object begins in the buffer
        self.args_end: int | None = None  # and ends, once its closing brace is in
        self.args_looked = 0  # the buffer before this holds no closing brace of them
        self.args_sent = 0  # characters of it streamed

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if not self.in_call:
                start = self.buffer.find(self.START)
                if start < 0:
                    keep = held_back(self.buffer, self.START)
                    self._content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                self._content(out, self.buffer[:start])
                self.buffer = self.buffer[start + len(self.START) :]
                self.in_call = True
                self._start_call()
                continue
            end = self.buffer.find(self.END)
            if end < 0:
                self._name_early(out)
                self._arguments_early(out)
                return out
            body = self.buffer[:end]
            self._close(out, body, self.START + body + self.END)
            self.buffer, self.in_call = self.buffer[end + len(self.END) :], False

    def finish(self) -> Parsed:
        """The end of the output: a call cut short (max_tokens) is one if its JSON is whole."""
        out, rest = Parsed(), self.buffer
        if self.in_call:
            self._close(out, rest, self.START + rest)
            self.in_call = False
        else:
            self._content(out, rest)
        self.buffer = ""
        return out

    def _content(self, out: Parsed, text: str) -> None:
        # Between and after calls the model writes newlines: no content of their own.
        if self.count and not text.strip():
            return
        out.content += text

    def _top_level(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        """The first match of `pattern` in the call that begins among the keys of the call's
        own object, not inside its arguments or a string."""
        depths = self.depths.of(self.buffer)
        return next((m for m in pattern.finditer(self.buffer) if depths[m.start()] == 1), None)

    def _name_early(self, out: Parsed) -> None:
        """The call's id and name as soon as the name is whole, before its arguments are."""
        if self.named:
            return
        match = self._top_level(_NAME)
        if match is None:
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:  # an escape JSON has not (`\q`): the whole call decides at its end
            return
        out.calls.append(CallDelta(self.count, "", new_call_id(), name))
        self.count += 1
        self.named = True

    def _arguments_early(self, out: Parsed) -> None:
        """The arguments' JSON object as it comes, once the name went out, up to its own closing
        brace (what follows it, the call's other keys included, is not the arguments)."""
        if not self.named:
            return
        if self.args_start is None:
            match = self._top_level(_ARGUMENTS)
            if match is None or not self.buffer[match.end() :].startswith("{"):
                return  # an arguments string, or not yet there: it goes whole at the end
            self.args_start = match.end()
        arguments = self._arguments(len(self.buffer))
        if len(arguments) > self.args_sent:
            out.calls.append(CallDelta(self.count - 1, arguments[self.args_sent :]))
            self.args_sent = len(arguments)

    def _arguments(self, limit: int) -> str:
        """The arguments' object in the buffer's first `limit` characters, whole or so far."""
        assert self.args_start is not None
        if self.args_end is None:
            depths = self.depths.of(self.buffer[:limit])
            # Its closing brace is the first `}` read at depth 2 (in the call, in the object).
            closing = next(
                (
                    i
                    for i in range(max(self.args_start, self.args_looked), limit)
                    if depths[i] == 2 and self.buffer[i] == "}"
                ),
                None,
            )
            self.args_looked = limit
            if closing is not None:
                self.args_end = closing + 1
        return self.buffer[self.args_start : self.args_end or limit]

    def _close(self, out: Parsed, body: str, as_text: str) -> None:
        """The call whose text is `body`, the buffer's start."""
        parsed = call_json(body.strip(), "arguments")
        if parsed is None and not self.named:
            out.content += as_text
            return
        if not self.named:
            assert parsed is not None
            name, arguments = parsed
            out.calls.append(CallDelta(self.count, "", new_call_id(), name))
            out.calls.append(CallDelta(self.count, arguments))
            self.count += 1
            return
        # Its name (and maybe part of its arguments) went out: the rest of its arguments.
        if self.args_start is not None:
            rest = self._arguments(len(body))[self.args_sent :]
        else:
            rest = "{}" if parsed is None else parsed[1]
        out.calls.append(CallDelta(self.count - 1, rest))


IN_STRING = -1  # _JsonDepths' depth of a character inside a string


class _JsonDepths:
    """The JSON nesting depth before each character of a call's text (IN_STRING inside a
    string), as the text grows: each character is read once, however many pieces it comes in
    (a scan of the whole text at each piece grew with the square of the arguments' length).
    Held as 4-byte ints: a list's were 8 bytes a character, for each of n choices."""

    def __init__(self) -> None:
        self.depths = array("i")
        self._depth, self._in_string, self._escaped = 0, False, False

    def of(self, text: str) -> array[int]:
        """The depths of `text`, which begins with every text given before."""
        for ch in text[len(self.depths) :]:
            self.depths.append(IN_STRING if self._in_string else self._depth)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
        return self.depths


class _Llama3:
    """The whole output decides: it is held until the end when it opens like a call, else
    streamed as content at once."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer = ""
        self.is_content: bool | None = None

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        if self.is_content is None:
            opening = self.buffer.lstrip()
            if not opening or self.TAG.startswith(opening):
                return Parsed()
            self.is_content = not (opening.startswith("{") or opening.startswith(self.TAG))
        if not self.is_content:
            return Parsed()
        text, self.buffer = self.buffer, ""
        return Parsed(content=text)

    def finish(self) -> Parsed:
        text, self.buffer = self.buffer, ""
        calls = _llama3_calls(text.strip().removeprefix(self.TAG).strip())
        return Parsed(content=text) if calls is None else _whole_calls(calls)


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_json(text[at:end], "parameters")
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return calls or None


class ForcedCalls:
    """tool_choice "required" or a named function: the output is the JSON that tool_grammar's
    schema forces, read back whole at the end (it is not the model's own call format, so no
    parser above can stream it). An output cut short (max_tokens) stays text."""

    def __init__(self, function: str | None):
        self.function = function  # None: "required", any of the tools
        self.buffer = ""

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        return Parsed()

    def finish(self) -> Parsed:
        text, self.buffer = self.buffer, ""
        try:
            return _whole_calls(constrained_tool_calls(text, self.function))
        except ValueError:
            return Parsed(content=text)


def _whole_calls(calls: list[tuple[str, str]]) -> Parsed:
    """Complete calls (name, arguments' JSON), each one delta: its first and only one."""
    return Parsed(
        calls=[CallDelta(i, args, new_call_id(), name) for i, (name, args) in enumerate(calls)]
    )


ToolCallParser = _Qwen25 | _Llama3 | ForcedCalls


def tool_call_parser(name: str) -> ToolCallParser:
    if name == "qwen25":
        return _Qwen25()
    if name == "llama3":
        return _Llama3()
    raise ValueError(f"tool call parser {name!r}: one of {', '.join(TOOL_CALL_PARSERS)}")


def merge_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """Deltas joined into whole calls, as OpenAI's message lists them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(
            delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if delta.id is not None:
            call["id"], call["function"]["name"] = delta.id, delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


def chunk_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """A stream chunk's deltas, one entry a call: a call's name and the start of its arguments
    can come in one piece of text, and OpenAI's clients take each index once a chunk (an older
    openai-python kept the first entry and dropped the arguments of the second)."""
    calls: dict[int, CallDelta] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = CallDelta(delta.index, delta.arguments, delta.id, delta.name)
            continue
        call.arguments += delta.arguments
        if delta.id is not None:
            call.id, call.name = delta.id, delta.name
    return [call.as_json() for call in calls.values()]


def parse_tool_calls(name: str, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole output: its content, and its tool calls."""
    parser = tool_call_parser(name)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, merge_calls(first.calls + last.calls)
