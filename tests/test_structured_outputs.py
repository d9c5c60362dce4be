"""Structured outputs end to end, on a live server of the default model (SmolLM2-135M-Instruct):
the `openai` package's chat.completions.parse with a pydantic model, json_object, regex and ebnf
through /generate on seeded requests at temperature 1 mixed with unconstrained ones, tool_choice
forcing a call, and bad or conflicting constraints refused with a 400 that names the field."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from enum import Enum
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.client.local_server import LaunchedServer, launched_server
from radixserve.protocol.wire import MAX_GRAMMAR_BYTES

REGEX = r"(yes|no), [0-9]{1,3} (cats|dogs)\."
EBNF = 'root ::= "[" num ("," num){0,3} "]"\nnum ::= [1-9] [0-9]?'
EBNF_TEXT = r"\[[1-9][0-9]?(,[1-9][0-9]?){0,3}\]"


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    address: Address
    hobbies: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server() -> Iterator[LaunchedServer]:
    with launched_server("--dtype", "float32", "--check-invariants") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.http_url}/v1/models").json()["data"][0]["id"]


def test_chat_parse_returns_the_pydantic_object(oai, model) -> None:
    messages = [{"role": "user", "content": "Describe a person who lives in Paris, as JSON."}]
    reply = oai.chat.completions.parse(
        model=model, messages=messages, response_format=Person, max_tokens=200, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    person = choice.message.parsed
    assert isinstance(person, Person)
    assert isinstance(person.favorite_color, Color) and len(person.hobbies) <= 3
    assert re.fullmatch(r"[0-9]{5}", person.address.zip_code)


def test_json_object_output_parses(oai, model) -> None:
    reply = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": 'Repeat this JSON: {"name": "Tom", "age": 3}'}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # On /v1/completions too, with a schema.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}}
    schema["required"] = ["n"]
    done = oai.completions.create(
        model=model,
        prompt="A number:",
        max_tokens=30,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            }
        },
    )
    assert json.loads(done.choices[0].text)["n"] <= 99


async def _generate_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in bodies))
    return [r.json() for r in replies]


def test_regex_and_ebnf_match_on_20_seeded_requests_each_in_mixed_batches(server) -> None:
    prompts = ["Do you like animals? Answer:", "List some numbers:"]
    bodies = []
    for seed in range(20):
        for field, spec, prompt in (("regex", REGEX, prompts[0]), ("ebnf", EBNF, prompts[1])):
            params = {field: spec, "temperature": 1.0, "seed": seed, "max_new_tokens": 24}
            bodies.append({"text": prompt, "sampling_params": params})
        if seed % 2:
            plain = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
            bodies.append({"text": f"Story {seed}:", "sampling_params": plain})
    replies = asyncio.run(_generate_all(server.http_url, bodies))
    texts = {"regex": [], "ebnf": []}
    for body, reply in zip(bodies, replies):
        params = body["sampling_params"]
        if "regex" in params:
            assert re.fullmatch(REGEX, reply["text"]), reply["text"]
            texts["regex"].append(reply["text"])
        elif "ebnf" in params:
            assert re.fullmatch(EBNF_TEXT, reply["text"]), reply["text"]
            texts["ebnf"].append(reply["text"])
        else:
            assert len(reply["output_ids"]) == 8
            continue
        assert reply["meta_info"]["finish_reason"]["type"] == "stop"
    # Sampled, not forced: 20 seeds give several different texts.
    assert len(set(texts["regex"])) > 1 and len(set(texts["ebnf"])) > 1


def test_n_stop_strings_and_logprobs_with_a_grammar(server) -> None:
    params = {"regex": REGEX, "temperature": 1.0, "seed": 1, "n": 3, "max_new_tokens": 24}
    body = {"text": "Do you like animals? Answer:", "sampling_params": params}
    body |= {"return_logprob": True}
    replies = httpx.post(f"{server.http_url}/generate", json=body, timeout=600).json()
    assert len(replies) == 3
    for reply in replies:
        assert re.fullmatch(REGEX, reply["text"])
        logprobs = reply["meta_info"]["output_token_logprobs"]
        assert len(logprobs) == len(reply["output_ids"]) and all(lp <= 0 for lp, _ in logprobs)
    stopped = httpx.post(
        f"{server.http_url}/generate",
        json={"text": "Do you like animals?", "sampling_params": {**params, "stop": [","]}},
        timeout=600,
    ).json()
    for reply in stopped:  # the stop string ends it inside the grammar
        assert re.fullmatch(r"yes|no", reply["text"]), reply["text"]


def test_tool_choice_forces_a_call_against_the_schema(oai, model) -> None:
    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time", "parameters": None}},
    ]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    # One call for "required" (parallel_tool_calls false): greedy, this small model repeats
    # `{"name": "get_time", "parameters": {}}` until max_tokens.
    for stream in (False, True):
        for choice, max_tokens in (
            ({"type": "function", "function": {"name": "get_weather"}}, 60),
            ("required", 80),
        ):
            calls = _tool_calls(
                oai.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=stream,
                    parallel_tool_calls=choice != "required",
                ),
                stream,
                # A call forced by name ends `stop`, as OpenAI's and vLLM's.
                "tool_calls" if choice == "required" else "stop",
            )
            assert calls, (choice, stream)
            for name, arguments in calls:
                assert name in {"get_weather", "get_time"}
                if name == "get_weather":
                    assert set(arguments) == {"city", "unit"}
                    assert arguments["unit"] in {"celsius", "fahrenheit"}
            if choice != "required":
                assert [name for name, _ in calls] == ["get_weather"]


def _tool_calls(answer, stream: bool, finish_reason: str) -> list[tuple[str, dict]]:
    """(name, parsed arguments) of the one choice's tool calls, which ends `finish_reason`."""
    if not stream:
        choice = answer.choices[0]
        assert choice.finish_reason == finish_reason and choice.message.content is None
        return [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in answer:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            if call.function.name:
                assert call.id and call.type == "function"
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert finish == finish_reason
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"sampling_params": {"regex": "[a-"}}, "regex"),
        ({"sampling_params": {"ebnf": "root ::= "}}, "ebnf"),
        ({"sampling_params": {"json_schema": '{"type": 5}'}}, "json_schema"),
        ({"sampling_params": {"json_schema": "{nope"}}, "json_schema"),
        ({"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "regex and ebnf"),
        ({"sampling_params": {"regex": "a" * (MAX_GRAMMAR_BYTES + 1)}}, "regex 131072"),
    ],
)
def test_bad_grammars_on_generate_are_400s_naming_the_field(server, body, names) -> None:
    reply = httpx.post(f"{server.http_url}/generate", json={"text": "Hi", **body}, timeout=60)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert all(name in message for name in names.split() if name != "and"), message


def test_conflicting_constraints_on_openai_are_400s_naming_them(oai, model) -> None:
    fmt = {"type": "json_object"}
    with pytest.raises(openai.BadRequestError, match="only one of response_format, regex"):
        oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            response_format=fmt,
            extra_body={"regex": "a"},
        )
    with pytest.raises(openai.BadRequestError, match="regex: ") as compile_error:
        oai.completions.create(model=model, prompt="Hi", extra_body={"regex": "(unclosed"})
    assert compile_error.value.body["param"] == "regex"  # the scheduler's compile names it
    schema = {"type": "object", "properties": {"a": {"type": "foo"}}}  # compiles to an error
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="json_schema: ") as compile_error:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], response_format=fmt
        )
    assert compile_error.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="'nope' is not among the tools"):
        oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
