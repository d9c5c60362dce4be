"""One chat choice's text on its way out, streamed or whole: the thinking split off into
`reasoning_content` (--reasoning-parser), then tool calls parsed out of the answer
(--tool-call-parser). Without either, the text is the content as it comes."""

from __future__ import annotations

from typing import Any

from radixserve.http_server.reasoning_parser import ReasoningParser
from radixserve.http_server.tool_parser import (
    CallDelta,
    ForcedCalls,
    ToolCallParser,
    chunk_calls,
    merge_calls,
)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools
        self.called = False  # a tool call went out

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The fields of a stream chunk's `delta` for the choice's next piece of text."""
        reasoning, content, calls = self._parse(text, finished)
        if self.reasoning is None and self.tools is None:
            return {"content": text}
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = chunk_calls(calls)
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole choice's `message`."""
        reasoning, content, calls = self._parse(text, finished=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = merge_calls(calls)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's `tool_calls` when the model ended on its own after calling tools; a call
        forced by name ends `stop`, as OpenAI's and vLLM's do."""
        named = isinstance(self.tools, ForcedCalls) and self.tools.function is not None
        return "tool_calls" if self.called and reason == "stop" and not named else reason

    def _parse(self, text: str, finished: bool) -> tuple[str, str, list[CallDelta]]:
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            reasoning, content = split.reasoning, split.content
            if finished:
                rest = self.reasoning.finish()
                reasoning, content = reasoning + rest.reasoning, content + rest.content
        calls: list[CallDelta] = []
        if self.tools is not None:
            parsed = self.tools.feed(content)
            content, calls = parsed.content, parsed.calls
            if finished:
                rest_tools = self.tools.finish()
                content, calls = content + rest_tools.content, calls + rest_tools.calls
        self.called = self.called or bool(calls)
        return reasoning, content, calls
