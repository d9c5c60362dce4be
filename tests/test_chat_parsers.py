"""The reasoning and tool call parsers as pure units: whole texts, and the same texts streamed in
pieces cut at every place (a tag split over chunks), which must give the same result."""

from __future__ import annotations

import json

import pytest

from radixserve.http_server.reasoning_parser import ReasoningParser, split_reasoning
from radixserve.http_server.tool_parser import (
    merge_calls,
    parse_tool_calls,
    tool_call_parser,
)

QWEN_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"tz": "CET"}}\n</tool_call>'
)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def streamed_reasoning(name: str, chunks: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(name)
    reasoning = content = ""
    for chunk in chunks:
        split = parser.feed(chunk)
        reasoning, content = reasoning + split.reasoning, content + split.content
    rest = parser.finish()
    return reasoning + rest.reasoning, content + rest.content


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        (
            "qwen3",
            "<think>\nsome thought\n</think>\n\nThe answer.",
            "\nsome thought\n",
            "The answer.",
        ),
        ("qwen3", "The answer, no thinking.", "", "The answer, no thinking."),
        ("qwen3", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
        ("qwen3", "<thin", "", "<thin"),  # not a tag after all
        (
            "deepseek-r1",
            "thought without the opening tag</think>Answer",
            "thought without the opening tag",
            "Answer",
        ),
        ("deepseek-r1", "<think>thought</think>\nAnswer", "thought", "Answer"),
        ("deepseek-r1", "all thinking", "all thinking", ""),
    ],
)
def test_reasoning_split_whole_and_streamed_at_every_cut(name, text, reasoning, content):
    whole = split_reasoning(name, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for size in range(1, len(text) + 1):
        assert streamed_reasoning(name, pieces(text, size)) == (reasoning, content), size


def test_qwen25_calls_whole():
    content, calls = parse_tool_calls("qwen25", QWEN_CALLS)
    assert content == "Let me look.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "CET"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_qwen25_streamed_name_first_then_arguments(size):
    parser = tool_call_parser("qwen25")
    content, deltas = "", []
    for chunk in pieces(QWEN_CALLS, size):
        out = parser.feed(chunk)
        content += out.content
        deltas += out.calls
    last = parser.finish()
    content, deltas = content + last.content, deltas + last.calls
    assert content == "Let me look.\n"
    # Each call: its first delta names it (id, name, no arguments yet), then fragments.
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id is not None and mine[0].name and mine[0].arguments == ""
        assert all(d.id is None and d.name is None for d in mine[1:])
    # The arguments come in fragments as they are written, and join into the same JSON.
    merged = merge_calls(deltas)
    whole = parse_tool_calls("qwen25", QWEN_CALLS)[1]
    assert [c["function"]["name"] for c in merged] == [c["function"]["name"] for c in whole]
    for got, want in zip(merged, whole):
        assert json.loads(got["function"]["arguments"]) == json.loads(want["function"]["arguments"])
    if size <= 5:
        assert len([d for d in deltas if d.index == 0 and d.arguments]) > 3


@pytest.mark.parametrize(
    "call, name, arguments",
    [
        # a key after the arguments: it was streamed as part of them
        ('{"name": "f", "arguments": {"a": 1}, "id": "z"}', "f", {"a": 1}),
        # the arguments first, holding a "name" of their own: that was taken for the call's
        ('{"arguments": {"name": "x", "s": "}{\\""}, "name": "f"}', "f", {"name": "x", "s": '}{"'}),
        # braces and quotes inside strings
        (
            '{"name": "f", "arguments": {"s": "a}b\\"c", "t": [{"u": "]"}]}}',
            "f",
            {"s": 'a}b"c', "t": [{"u": "]"}]},
        ),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 64])
def test_qwen25_streams_exactly_the_calls_own_name_and_arguments(call, name, arguments, size):
    text = f"<tool_call>{call}</tool_call>"
    _, whole = parse_tool_calls("qwen25", text)
    assert whole[0]["function"]["name"] == name
    assert json.loads(whole[0]["function"]["arguments"]) == arguments
    parser, deltas = tool_call_parser("qwen25"), []
    for chunk in pieces(text, size):
        deltas += parser.feed(chunk).calls
    deltas += parser.finish().calls
    [streamed] = merge_calls(deltas)
    assert streamed["function"]["name"] == name
    assert json.loads(streamed["function"]["arguments"]) == arguments


def test_qwen25_a_name_json_cannot_read_stays_text_streamed_too():
    """`\\q` is no JSON escape: the streamed name's json.loads raised in the middle of a
    stream; now the whole call decides at its end, as unstreamed (not a call: text)."""
    text = '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>'
    parser, content = tool_call_parser("qwen25"), ""
    for chunk in pieces(text, 3):
        out = parser.feed(chunk)
        assert not out.calls
        content += out.content
    assert content + parser.finish().content == text == parse_tool_calls("qwen25", text)[0]


def test_qwen25_not_a_call_stays_text_and_a_cut_call_parses_if_whole():
    broken = "Hi <tool_call>not json</tool_call> there"
    assert parse_tool_calls("qwen25", broken) == (broken, [])
    assert parse_tool_calls("qwen25", "plain <tool") == ("plain <tool", [])
    content, calls = parse_tool_calls("qwen25", '<tool_call>{"name": "f", "arguments": {}}')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_llama3_calls(text):
    for size in (1, 4, len(text)):
        parser = tool_call_parser("llama3")
        outs = [parser.feed(chunk) for chunk in pieces(text, size)] + [parser.finish()]
        assert "".join(o.content for o in outs) == ""
        calls = merge_calls([d for o in outs for d in o.calls])
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_llama3_two_calls_and_plain_text():
    two = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = parse_tool_calls("llama3", two)
    assert content == "" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_tool_calls("llama3", "Paris is sunny.") == ("Paris is sunny.", [])
    assert parse_tool_calls("llama3", '{"not": "a call"}') == ('{"not": "a call"}', [])
    # Plain text streams at once, not held to the end.
    parser = tool_call_parser("llama3")
    assert parser.feed("Paris").content == "Paris"


def test_the_prompts_last_tag_says_where_the_output_starts() -> None:
    """One rule for the scheduler's grammar and the chat split: the prompt's last tag, where the
    tags are one token each; else (and with no tag in the prompt) as the parser's template."""
    from radixserve.protocol.reasoning_tags import ThinkTags, starts_thinking

    tags = ThinkTags(start=7, end=8)
    for parser, untagged in (("qwen3", False), ("deepseek-r1", True)):
        assert starts_thinking(parser, [1, 2, 3], tags) is untagged
        assert starts_thinking(parser, [1, 7, 4, 8, 5], None) is untagged
        assert starts_thinking(parser, [1, 8, 2, 7, 4], tags) is True  # the template opened it
        assert starts_thinking(parser, [1, 7, 2, 8, 4], tags) is False  # it closed it again
