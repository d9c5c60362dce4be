"""tool_choice -> a JSON schema (http_server/tool_grammar.py): what the schema allows, checked by
xgrammar's own matcher on real tokens, and the constrained output read back as calls."""

from __future__ import annotations

import json

import msgspec
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from radixserve.http_server.openai_protocol import ChatCompletionRequest, grammar_params
from radixserve.http_server.tool_grammar import constrained_tool_calls, tool_call_schema
from radixserve.model_worker.model_source import default_model_dir

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FUNCTIONS = {"get_weather": WEATHER, "ping": None}


@pytest.fixture(scope="module")
def compiler() -> tuple[xgr.GrammarCompiler, object]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    return xgr.GrammarCompiler(info, cache_enabled=False), tokenizer


def accepts(compiler, schema: str, value: object) -> bool:
    """Whether the grammar of `schema` takes `value` as json.dumps writes it (", " and ": ": the
    separators of xgrammar's JSON without free whitespace) and then ends."""
    compiler, tokenizer = compiler
    text = json.dumps(value)
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
    ok = all(matcher.accept_token(t) for t in tokenizer.encode(text))
    return ok and matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_a_named_function_allows_its_arguments_only(compiler) -> None:
    schema = tool_call_schema(FUNCTIONS, "get_weather")
    assert accepts(compiler, schema, {"city": "Oslo", "unit": "c"})
    assert not accepts(compiler, schema, {"city": "Oslo", "unit": "k"})
    assert not accepts(compiler, schema, {"city": "Oslo"})
    calls = constrained_tool_calls('{"city":"Oslo","unit":"c"}', "get_weather")
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})
    ]
    # A function without parameters takes none (OpenAI: "an empty parameter list"): any object
    # let a model invent arguments that the function does not take.
    assert accepts(compiler, tool_call_schema(FUNCTIONS, "ping"), {})
    assert not accepts(compiler, tool_call_schema(FUNCTIONS, "ping"), {"x": 1})
    assert not accepts(compiler, tool_call_schema({"ping": {}}, "ping"), {"x": 1})


def test_required_allows_a_non_empty_list_of_the_tools_calls(compiler) -> None:
    schema = tool_call_schema(FUNCTIONS, None)
    two = '[{"name":"get_weather","parameters":{"city":"Rome","unit":"f"}},' + (
        '{"name":"ping","parameters":{}}]'
    )
    assert accepts(compiler, schema, json.loads(two))
    assert not accepts(compiler, schema, json.loads("[]"))
    assert not accepts(compiler, schema, json.loads('[{"name":"other","parameters":{}}]'))
    assert not accepts(
        compiler, schema, json.loads('[{"name":"get_weather","parameters":{"city":"R"}}]')
    )
    assert not accepts(
        compiler, schema, json.loads('[{"name":"ping","parameters":{"city":"Rome"}}]')
    )
    names = [name for name, _ in constrained_tool_calls(two, None)]
    assert names == ["get_weather", "ping"]
    with pytest.raises(ValueError, match="incomplete"):
        constrained_tool_calls('[{"name":"pi', None)


def test_the_chat_request_maps_tool_choice_to_one_json_schema() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]

    def decode(**fields) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert grammar_params(decode(tools=tools, tool_choice=named)) == {
        "json_schema": json.dumps(WEATHER)
    }
    assert "json_schema" in grammar_params(decode(tools=tools, tool_choice="required"))
    assert grammar_params(decode(tools=tools, tool_choice="auto")) == {}
    with pytest.raises(ValueError, match="only one of response_format, tool_choice"):
        grammar_params(
            decode(tools=tools, tool_choice="required", response_format={"type": "json_object"})
        )
    with pytest.raises(ValueError, match="need tools"):
        grammar_params(decode(tool_choice="required"))


def test_parallel_tool_calls_false_allows_one_call(compiler) -> None:
    one = [{"name": "ping", "parameters": {}}]
    two = [*one, {"name": "ping", "parameters": {}}]
    schema = tool_call_schema(FUNCTIONS, None, parallel=False)
    assert accepts(compiler, schema, one) and not accepts(compiler, schema, two)
    assert accepts(compiler, tool_call_schema(FUNCTIONS, None), two)


def test_a_forced_call_comes_back_as_tool_calls_whatever_the_reasoning_parser() -> None:
    """The grammar's JSON is read back as tool_calls. deepseek-r1's parser that thinks first
    would take an output the grammar wrote from its first token whole: the API builds it so only
    where the scheduler holds the grammar until </think> (protocol/reasoning_tags.py)."""
    from radixserve.http_server.chat_output import ChatOutput
    from radixserve.http_server.reasoning_parser import ReasoningParser
    from radixserve.http_server.tool_parser import ForcedCalls

    output = ChatOutput(None, ForcedCalls("get_weather"))
    streamed = [output.delta(piece, False) for piece in ('{"city": "Pa', 'ris", "unit": "c"}')]
    last = output.delta("", True)
    assert all("content" not in d and "tool_calls" not in d for d in streamed)
    (call,) = last["tool_calls"]  # one entry: id, name and the whole arguments
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert output.finish_reason("stop") == "stop"  # forced by name, as OpenAI's and vLLM's
    required = ChatOutput(None, ForcedCalls(None))
    required.delta('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]', True)
    assert required.finish_reason("stop") == "tool_calls"
    thinking = ReasoningParser("deepseek-r1")
    swallowed = ChatOutput(thinking, ForcedCalls("get_weather")).message('{"city": "Paris"}')
    assert "tool_calls" not in swallowed
    answering = ReasoningParser("deepseek-r1", thinks_first=False)  # the prompt closed it
    called = ChatOutput(answering, ForcedCalls("get_weather")).message('{"city": "Paris"}')
    assert called["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_chat_template_kwargs_are_plain_variables_only() -> None:
    from radixserve.http_server.openai_protocol import BadField, template_kwargs

    def decode(kwargs: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        body["chat_template_kwargs"] = kwargs
        return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)

    assert template_kwargs(decode({"enable_thinking": False})) == {"enable_thinking": False}
    for own in ("chat_template", "tokenizer_kwargs", "documents", "return_dict", "tokenize"):
        with pytest.raises(BadField, match=own):
            template_kwargs(decode({own: "{{ 'x' * 10 }}"}))
    with pytest.raises(msgspec.ValidationError):
        decode({"enable_thinking": {"nested": "object"}})
