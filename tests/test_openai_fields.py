"""Every OpenAI field clients send, with the real `openai` package against one live server of the
tiny model (float32, a served name, both output parsers on): accepted and honoured, or refused
with a 400 whose `param` names the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.client.local_server import LaunchedServer, launched_server

NAME = "tiny-served"
CONTEXT = 192
CHAT = [{"role": "user", "content": "Hi there"}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_served_model) -> Iterator[LaunchedServer]:
    flags = (
        *("--model", str(tiny_served_model), "--dtype", "float32", "--served-model-name", NAME),
        *("--context-length", str(CONTEXT), "--max-total-tokens", "4096"),
        *("--chunked-prefill-size", "48"),  # prompt logprobs come over several chunks
        "--enable-overlap-schedule",  # the step after a chunk is planned before its logprobs
        *("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"),
    )
    with launched_server(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_served_model):
    return AutoTokenizer.from_pretrained(tiny_served_model)


def refused(call, param: str, code: int = 400) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == code, info.value.body
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    return error


def test_served_model_name_and_the_fields_applications_send(oai):
    assert [m.id for m in oai.models.list().data] == [NAME]
    assert oai.models.retrieve(NAME).id == NAME  # GET /v1/models/{name}
    refused(lambda: oai.models.retrieve("other"), "model", 404)
    chat = oai.chat.completions.create(
        model=NAME,
        messages=[
            {"role": "system", "content": "Be brief.", "name": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ],
        max_tokens=4,
        temperature=0,
        user="u-1",
        metadata={"trace": "abc"},
        store=False,
        service_tier="auto",
        logit_bias={},
        parallel_tool_calls=True,
        extra_body={"separate_reasoning": True},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    # A text given as parts is the same prompt as one string.
    whole = oai.chat.completions.create(
        model=NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert whole.usage.prompt_tokens == chat.usage.prompt_tokens
    refused(lambda: oai.completions.create(model="other", prompt="a"), "model", 404)


def test_logit_bias_forces_and_bans_tokens(oai, tokenizer):
    (forced,) = tokenizer(" the", add_special_tokens=False).input_ids
    out = oai.completions.create(
        model=NAME, prompt="Once upon", max_tokens=5, temperature=0, logit_bias={str(forced): 100}
    )
    assert out.choices[0].text == " the" * 5
    plain = oai.completions.create(
        model=NAME, prompt="Once upon", max_tokens=1, temperature=0, logprobs=0
    )
    first = plain.choices[0].logprobs.tokens[0]
    (first_id,) = tokenizer(first, add_special_tokens=False).input_ids[-1:]
    banned = oai.completions.create(
        model=NAME,
        prompt="Once upon",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first_id): -100},
    )
    assert banned.choices[0].text != first
    refused(
        lambda: oai.completions.create(model=NAME, prompt="a", logit_bias={"5": 101}), "logit_bias"
    )
    refused(
        lambda: oai.completions.create(model=NAME, prompt="a", logit_bias={"99999999": 1}),
        "logit_bias",
    )
    refused(  # a key that is no token id (msgspec's message names it "`key` in `$.logit_bias`")
        lambda: oai.completions.create(model=NAME, prompt="a", logit_bias={"abc": 1}), "logit_bias"
    )


@pytest.mark.parametrize("prompt", ["", ["Hi", ""], [[1], []]])  # `[]`: the decoder's 400
def test_an_empty_prompt_is_a_400_naming_prompt(oai, prompt):
    """It was the wire's "text must not be empty", naming a field OpenAI's API has not."""
    error = refused(
        lambda: oai.completions.create(model=NAME, prompt=prompt, max_tokens=1), "prompt"
    )
    assert error["message"] == "prompt must not be empty"


def test_more_prompts_than_a_client_may_have_pending_is_a_400(oai):
    """Each prompt is one of the client's pending requests (256 by default): past that, every
    try met the cap as a 503 to retry, which no retry could cure."""
    refused(lambda: oai.completions.create(model=NAME, prompt=["Hi"] * 257, max_tokens=1), "prompt")
    fits = oai.completions.create(model=NAME, prompt=["Hi"] * 256, max_tokens=1)
    assert len(fits.choices) == 256


def test_a_stop_string_that_is_a_special_token_stops(oai, tokenizer):
    """stop=["<|im_start|>"] with special tokens skipped (the default): its text never reaches
    the stop strings' matcher, so it is matched as a stop token (as SGLang matches it)."""
    special = "<|im_start|>"
    (token,) = tokenizer.convert_tokens_to_ids([special])
    forced = {"logit_bias": {str(token): 100}, "max_tokens": 6, "temperature": 0}
    plain = oai.completions.create(model=NAME, prompt="Hi", **forced)
    assert plain.usage.completion_tokens == 6  # the special token, drawn again and again
    stopped = oai.completions.create(model=NAME, prompt="Hi", stop=[special], **forced)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == "" and stopped.choices[0].model_extra["matched_stop"] == token
    # With the stop token ids at their bound (as repeats): still within it, still served.
    full = {"stop_token_ids": [0] * 1024}
    bounded = oai.completions.create(
        model=NAME, prompt="Hi", stop=[special], extra_body=full, **forced
    )
    assert bounded.usage.completion_tokens == 1
    assert oai.completions.create(model=NAME, prompt="Hi", max_tokens=1).usage  # still up


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(server, oai):
    """The greedy first token made a stop token ends the completion at once; with min_tokens 4
    it cannot be drawn until 4 tokens are out. Its text made a stop string: likewise."""
    body = {"text": "Once upon", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    first = httpx.post(f"{server.http_url}/generate", json=body, timeout=60).json()["output_ids"][0]
    stop = {"stop_token_ids": [first]}
    plain = oai.completions.create(
        model=NAME, prompt="Once upon", max_tokens=8, temperature=0, extra_body=stop
    )
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].model_extra["matched_stop"] == first  # the stop token's id
    held = oai.completions.create(
        model=NAME,
        prompt="Once upon",
        max_tokens=8,
        temperature=0,
        extra_body={**stop, "min_tokens": 4},
    )
    assert held.usage.completion_tokens >= 4
    # A stop string, as vLLM's min_tokens holds them: the first token's text went by.
    word = httpx.post(f"{server.http_url}/generate", json=body, timeout=60).json()["text"]
    ended, went_by = (
        oai.completions.create(
            model=NAME, prompt="Once upon", max_tokens=8, temperature=0, stop=[word], **more
        )
        for more in ({}, {"extra_body": {"min_tokens": 4}})
    )
    assert (ended.usage.completion_tokens, ended.choices[0].text) == (1, "")
    assert went_by.usage.completion_tokens >= 4 and went_by.choices[0].text.startswith(word)
    refused(
        lambda: oai.completions.create(
            model=NAME, prompt="a", max_tokens=2, extra_body={"min_tokens": 3}
        ),
        "min_tokens",
    )


def test_max_tokens_against_the_context(oai):
    """Chat without max_tokens runs to the context; max_tokens past it is a 400."""
    chat = oai.chat.completions.create(
        model=NAME, messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT
    assert chat.choices[0].finish_reason == "length"
    error = refused(
        lambda: oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=CONTEXT),
        "max_tokens",
    )
    # OpenAI's code and words, which clients match to trim a conversation.
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    refused(
        lambda: oai.completions.create(model=NAME, prompt="Hi", max_tokens=CONTEXT), "max_tokens"
    )
    # max_completion_tokens, OpenAI's newer name, wins over max_tokens (as vLLM reads them).
    newer = oai.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=2, max_completion_tokens=3, extra_body=IGNORE_EOS
    )
    assert newer.usage.completion_tokens == 3
    refused(
        lambda: oai.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=2, max_completion_tokens=CONTEXT
        ),
        "max_completion_tokens",
    )


def test_null_is_a_fields_default(oai, server):
    """OpenAI's fields are "... or null", and its SDK sends an argument given as None as null."""
    chat = oai.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=2, n=None, stream=None, logprobs=None, seed=None
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    text = oai.completions.create(model=NAME, prompt="Hi", max_tokens=2, echo=None, n=None)
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("Hi")
    # No model named: the one served (as vLLM).
    body = {"messages": CHAT, "max_tokens": 2, "model": None}
    reply = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == NAME


def test_stream_options(oai):
    """Fields of OpenAI's (and vLLM's) inside stream_options are taken; stream_options without
    stream is OpenAI's 400; every chunk of a stream has one id and one creation time."""
    chunks = list(
        oai.chat.completions.create(
            model=NAME,
            messages=CHAT,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
            extra_body=IGNORE_EOS,
        )
    )
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    assert len({(c.id, c.created) for c in chunks}) == 1
    refused(
        lambda: oai.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=2, stream_options={"include_usage": True}
        ),
        "stream_options",
    )


def test_what_cannot_be_honoured_names_its_field(oai, server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    error = refused(
        lambda: oai.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": [image]}]
        ),
        "messages",
    )
    assert "image_url" in error["message"]
    refused(
        lambda: oai.chat.completions.create(
            model=NAME, messages=CHAT, extra_body={"frobnicate": 1}
        ),
        "frobnicate",
    )
    refused(
        lambda: oai.chat.completions.create(model=NAME, messages=CHAT, temperature=-1),
        "temperature",
    )
    refused(lambda: oai.chat.completions.create(model=NAME, messages=CHAT, n=0), "n")
    # 404 and 405 in OpenAI's JSON shape.
    for method, path, status in (
        ("POST", "/v1/nothing", 404),
        ("GET", "/v1/chat/completions", 405),
    ):
        r = httpx.request(method, f"{server.http_url}{path}", timeout=30)
        assert r.status_code == status
        assert r.json()["error"]["message"] and r.json()["error"]["type"]


def test_tools_auto_none_and_forced_without_tools(oai):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    history = [
        *CHAT,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    for choice in ("auto", "none"):
        for stream in (False, True):
            answer = oai.chat.completions.create(
                model=NAME,
                messages=history,
                tools=tools,
                tool_choice=choice,
                max_tokens=6,
                temperature=0,
                stream=stream,
            )
            if stream:
                chunks = list(answer)
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            else:
                # The tiny model's noise holds no call: it all stays content.
                message = answer.choices[0].message
                assert message.tool_calls is None and isinstance(message.content, str)
                assert answer.choices[0].finish_reason in ("stop", "length")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        refused(  # forced calls are tests/test_structured_outputs.py's; without tools, a 400
            lambda choice=choice: oai.chat.completions.create(
                model=NAME, messages=CHAT, tool_choice=choice
            ),
            "tool_choice",
        )


def test_echo_loglikelihood_equals_a_transformers_forward(oai, tokenizer, tiny_served_model):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 0) over a prompt of three
    prefill chunks: the prompt's token logprobs equal transformers' within 1e-3 in float32, the
    first null; asked again (the prompt now in the prefix cache) and as token ids, the same."""
    text = " ".join(f"word{i}" for i in range(40))
    ids = tokenizer(text).input_ids
    assert 96 < len(ids) < CONTEXT
    model = AutoModelForCausalLM.from_pretrained(tiny_served_model, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logprobs[q - 1, ids[q]].item() for q in range(1, len(ids))]
    for prompt in (text, text, ids):
        out = oai.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        (choice,) = out.choices
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        assert choice.text == tokenizer.decode(ids) if prompt is ids else choice.text == text
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) and got[0] is None
        assert max(abs(a - b) for a, b in zip(got[1:], expected)) < 1e-3
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
        top = choice.logprobs.top_logprobs
        assert top[0] is None
        for q in range(1, len(ids)):
            ((_, best),) = top[q].items()
            assert abs(best - logprobs[q - 1].max().item()) < 1e-3
    # With a completion after it: the prompt's logprobs, then the new tokens'.
    more = oai.completions.create(
        model=NAME, prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0
    )
    (choice,) = more.choices
    plain = oai.completions.create(model=NAME, prompt=text, max_tokens=3, temperature=0)
    assert choice.text == text + plain.choices[0].text
    assert len(choice.logprobs.token_logprobs) == len(ids) + 3
    assert (
        max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs[1 : len(ids)], expected))
        < 1e-3
    )


def test_a_default_max_tokens_fits_the_kv_pool_as_well_as_the_context():
    """Chat without max_tokens asked for the whole context: refused (too_long) by a server
    whose KV pool is smaller than its context."""
    from radixserve.http_server.openai_protocol import BadField, max_new_tokens

    assert max_new_tokens(None, None, 100, (40960, 8192)) == 8092
    assert max_new_tokens(None, None, 100, (4096, 1 << 20)) == 3996
    assert max_new_tokens(None, 16, 100, (4096, 200)) == 16
    assert max_new_tokens(3000, None, 100, (4096, 200)) == 3000  # the scheduler says too_long
    with pytest.raises(BadField, match="maximum context length is 4096 tokens"):
        max_new_tokens(4000, None, 100, (4096, 1 << 20))


def test_every_chunk_of_a_stream_has_its_creation_time():
    """One `created` for a response, as OpenAI's: a stream over a second long kept it."""
    import time

    from radixserve.http_server.openai_responses import chunk_body, completion_body, new_head

    head = new_head(NAME, chat=True)
    time.sleep(1.05)
    assert chunk_body(head, [])["created"] == head.created
    assert completion_body(head, [], None)["created"] == head.created


def test_output_top_logprobs_are_bounded_over_every_completion():
    """n completions of each prompt, each with top logprobs at every new token: bounded in all,
    naming the field. Chat without max_tokens runs as far as the context and the bound allow."""
    from radixserve.http_server.openai_protocol import (
        BadField,
        ChatCompletionRequest,
        CompletionRequest,
        chat_generate,
        completion_generates,
    )
    from radixserve.protocol.wire import MAX_OUTPUT_TOP_LOGPROBS

    limits = (40960, 262144)
    chat = {"messages": CHAT, "logprobs": True, "top_logprobs": 256, "n": 128}
    generate, _ = chat_generate(msgspec.convert(chat, ChatCompletionRequest), [1, 2], limits, "c")
    assert generate.sampling_params.max_new_tokens == MAX_OUTPUT_TOP_LOGPROBS // (256 * 128)
    with pytest.raises(BadField) as refused_chat:
        chat_generate(
            msgspec.convert(chat | {"max_tokens": 33}, ChatCompletionRequest), [1], limits, "c"
        )
    assert refused_chat.value.param == "top_logprobs"
    text = {"prompt": ["a", "b"], "logprobs": 256, "n": 2, "max_tokens": 1025}
    with pytest.raises(BadField) as refused_text:  # 2 prompts x 2 x 1,025 x 256 > 2^20
        completion_generates(msgspec.convert(text, CompletionRequest), [[1], [2]], limits, "c")
    assert refused_text.value.param == "logprobs" and "4 completions" in str(refused_text.value)
    fits = text | {"max_tokens": 1024}
    generates, _ = completion_generates(
        msgspec.convert(fits, CompletionRequest), [[1], [2]], limits, "cmpl-x"
    )
    assert [g.rid for g in generates] == ["cmpl-x-0", "cmpl-x-1"]  # the client's id, in the log


def test_echoed_prompt_top_logprobs_in_all_are_bounded_naming_logprobs():
    """echo with logprobs scores every prompt token: 256 top logprobs over a 5,000-token prompt
    is past MAX_PROMPT_TOP_LOGPROBS, a 400 naming `logprobs` (vLLM caps logprobs at 20)."""
    import msgspec

    from radixserve.http_server.openai_protocol import (
        BadField,
        CompletionRequest,
        completion_generates,
    )

    limits = (1 << 20, 1 << 20)
    prompt = [[7] * 5000]

    def request(**fields) -> CompletionRequest:
        body = {"model": NAME, "prompt": prompt[0], "max_tokens": 0, **fields}
        return msgspec.convert(body, CompletionRequest)

    with pytest.raises(BadField, match="logprobs: 256 top logprobs for each") as info:
        completion_generates(request(echo=True, logprobs=256), prompt, limits, "c")
    assert info.value.param == "logprobs"
    (fine,), _ = completion_generates(request(echo=True, logprobs=20), prompt, limits, "c")
    assert fine.top_logprobs_num == 20 and fine.logprob_start_len == 0
    (unechoed,), _ = completion_generates(request(logprobs=256), prompt, limits, "c")
    assert unechoed.logprob_start_len == -1  # no prompt logprobs: nothing to bound


def test_completion_text_offsets_index_the_choices_text():
    """The prompt's tokens from 0, the output's from where its text begins in the choice's
    text: after the echoed prompt's, which is its tokens' texts but for a BOS the echo leaves
    out (`<s>` here). The API gives this base to a whole answer and to a stream alike (a
    whole one counted from its prompt tokens' texts)."""
    from radixserve.http_server.openai_responses import completion_logprobs
    from radixserve.protocol.wire import MetaInfo, OutputReply

    texts = {1: "<s>", 2: "Hi", 3: " there", 4: "!"}
    meta = MetaInfo(
        3,
        1,
        0,
        None,
        0.0,
        output_token_logprobs=[(-0.5, 4)],
        input_token_logprobs=[(None, 1), (-1.0, 2), (-2.0, 3)],
    )
    reply = OutputReply("cmpl-x-0", "!", [4], True, meta)
    echoed = "Hi there"  # what the echo shows: the prompt decoded without its BOS
    logprobs = completion_logprobs(reply, texts, len(echoed))
    assert logprobs["text_offset"] == [0, 3, 5, len(echoed)]
    assert (echoed + reply.text)[logprobs["text_offset"][-1] :] == "!"
    assert logprobs["token_logprobs"] == [None, -1.0, -2.0, -0.5]
