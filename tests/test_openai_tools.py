"""Tool calls and reasoning through the whole HTTP path, with a model output in their formats.

No model here writes `<tool_call>` by itself (the tiny model's greedy text is noise), so the test
plays the scheduler and the detokenizer (tm_harness): the real app and tokenizer manager take
the `openai` package's request, the test reads the prompt the chat template rendered (with the
tools and chat_template_kwargs), then answers with a tool call's text in the pieces the real
tokenizer's incremental decoding makes, as the detokenizer would. The `openai` package parses
the response, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tm_harness import tokenizer_manager
from transformers import AutoTokenizer

from radixserve.http_server.app import build_app
from radixserve.protocol.internal import TokenizedGenerateReq
from radixserve.protocol.wire import FinishReason

# A template that shows what reached it: the tools' names, enable_thinking (off: the thinking
# closed in the prompt, as Qwen3's template writes it), a tool call and a tool's answer in the
# history.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{% endif %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK<think></think>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
OUTPUT = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
HISTORY = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Lyon?"}],
    },
    {
        # As OpenAI's SDK writes its own reply back into the history: its fields beyond ours.
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And in Paris?", "name": "ann"},
]


@pytest.fixture(scope="module")
def model_dir(tiny_served_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools-template")
    for item in tiny_served_model.iterdir():
        if item.name != "chat_template.jinja":
            (path / item.name).symlink_to(item)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def thinking_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model_dir's model, its tokenizer with <think> and </think> one token each (as Qwen3's and
    DeepSeek-R1's are): where the scheduler can hold a grammar until the thinking ends. (The
    test plays the scheduler: the model's rows for them need not exist, only its config's.)"""
    path = tmp_path_factory.mktemp("tools-thinking")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(path)
    config = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
    for item in model_dir.iterdir():
        if not (path / item.name).exists():
            (path / item.name).symlink_to(item)
    return path


def detokenized_pieces(model_dir: Path, text: str) -> list[tuple[int, str]]:
    """(token, new text) for each token of `text`, as incremental decoding hands them out."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces, before = [], ""
    for k in range(len(ids)):
        now = tokenizer.decode(ids[: k + 1])
        pieces.append((ids[k], now[len(before) :]))
        before = now
    assert "".join(p for _, p in pieces) == text
    return pieces


async def serve_one(
    model_dir: Path,
    stream: bool,
    whole: bool = False,
    output: str = OUTPUT,
    parser: str = "qwen3",
    **create: Any,
) -> tuple[Any, str]:
    """The SDK's answer to one chat request, the scheduler's part played by the test; and the
    prompt the template rendered. The output comes token by token, or (whole) in one piece."""
    async with tokenizer_manager(
        model_dir, tool_call_parser="qwen25", reasoning_parser=parser
    ) as h:
        transport = httpx.ASGITransport(app=build_app(h.manager))
        http = httpx.AsyncClient(transport=transport, base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="-", http_client=http)

        async def ask() -> Any:
            answer = await client.chat.completions.create(
                model=str(model_dir), messages=HISTORY, tools=TOOLS, stream=stream, **create
            )
            return [chunk async for chunk in answer] if stream else answer

        task = asyncio.create_task(ask())
        msg = await h.to_scheduler()
        assert isinstance(msg, TokenizedGenerateReq)
        prompt = AutoTokenizer.from_pretrained(model_dir).decode(msg.input_ids)
        pieces = detokenized_pieces(model_dir, output)
        if whole:
            await h.output(msg.rid, [t for t, _ in pieces], FinishReason("stop", 0), text=output)
            return await asyncio.wait_for(task, 30), prompt
        for k, (token, text) in enumerate(pieces):
            end = FinishReason("stop", 0) if k == len(pieces) - 1 else None
            await h.output(msg.rid, [token], end, text=text)
        return await asyncio.wait_for(task, 30), prompt


def test_tools_and_template_kwargs_reach_the_template_and_the_call_parses(model_dir):
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    answer, prompt = asyncio.run(serve_one(model_dir, False, tool_choice="auto", **kwargs))
    assert "TOOLS:get_weather;" in prompt and "NOTHINK" in prompt
    assert "Weather in Lyon?" in prompt and "CALL get_weather(Lyon)" in prompt
    assert "sunny FOR call_1" in prompt
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "Let me check.\n"
    assert message.reasoning_content == "\nThe user wants the weather.\n"
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_id_and_name_then_arguments(model_dir):
    chunks, _ = asyncio.run(serve_one(model_dir, True))
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: its id, type and name
                assert call.index == len(calls) and call.function.name == "get_weather"
                assert call.type == "function"
                calls.append({"id": call.id, "arguments": call.function.arguments})
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert reasoning == "\nThe user wants the weather.\n" and content == "Let me check.\n"
    assert len(calls) == 1 and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    # The tags came split over several pieces, as the tokenizer cut them.
    assert len(chunks) > 10
    # While the parsers held a tag's pieces back, no chunk went out empty (as vLLM's).
    for chunk in chunks:
        (choice,) = chunk.choices
        assert choice.delta.model_dump(exclude_none=True) or choice.finish_reason, chunk


def test_a_call_written_in_one_piece_streams_as_one_entry_a_chunk(model_dir):
    """Name and arguments parsed from one piece of text: one tool_calls entry for the call in
    that chunk (an older openai-python kept only the first of two with the same index)."""
    chunks, _ = asyncio.run(serve_one(model_dir, True, whole=True))
    entries = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    for chunk in chunks:
        indexes = [call.index for call in chunk.choices[0].delta.tool_calls or []]
        assert len(indexes) == len(set(indexes)), chunk
    (call,) = entries
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


FORCED = {"type": "function", "function": {"name": "get_weather"}}


def answer_parts(answer: Any, stream: bool) -> tuple[str, str, str]:
    """(reasoning, content, the first call's arguments) of a chat answer, streamed or not."""
    if stream:
        deltas = [chunk.choices[0].delta for chunk in answer]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls or []]
        arguments = "".join(call.function.arguments or "" for call in calls)
        return reasoning, "".join(d.content or "" for d in deltas), arguments
    message = answer.choices[0].message
    calls = message.tool_calls or []
    arguments = calls[0].function.arguments if calls else ""
    return getattr(message, "reasoning_content", None) or "", message.content or "", arguments


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_forced_by_name_after_the_thinking(thinking_dir, stream):
    """With --reasoning-parser a grammar shapes the answer after </think> (the scheduler's
    part): the thinking goes to reasoning_content, and the forced call's arguments are the rest."""
    output = '<think>\nParis, then.\n</think>\n\n{"city": "Paris"}'
    answer, _ = asyncio.run(serve_one(thinking_dir, stream, output=output, tool_choice=FORCED))
    reasoning, content, arguments = answer_parts(answer, stream)
    assert reasoning == "\nParis, then.\n" and content == ""
    assert json.loads(arguments) == {"city": "Paris"}


@pytest.mark.parametrize("closed", [False, True])
def test_a_forced_call_where_no_thinking_comes_first(model_dir, thinking_dir, closed):
    """deepseek-r1 thinks first, unless no grammar waits for it (the tags are not one token
    each: the grammar writes from the first token) or the prompt closed the thinking (its
    template with the thinking off): then the whole output is the call's arguments."""
    where = thinking_dir if closed else model_dir
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}} if closed else {}
    output = '{"city": "Paris"}'
    answer, prompt = asyncio.run(
        serve_one(where, False, output=output, parser="deepseek-r1", tool_choice=FORCED, **kwargs)
    )
    assert ("<think></think>" in prompt) == closed
    reasoning, content, arguments = answer_parts(answer, False)
    assert (reasoning, content) == ("", "") and json.loads(arguments) == {"city": "Paris"}
