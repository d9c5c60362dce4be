"""The HTTP front door, driven by the real `openai` package and httpx against one live server of
the tiny model (its text is noise, but a fixed function of the prompt): OpenAI's completions and
chat, streamed and not, SGLang's native endpoints, an SSE client that leaves, and /metrics. Each
answer is checked against the ZMQ client's answer to the same request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tm_harness import tokenizer_manager

from radixserve.client import Client
from radixserve.client.local_server import LaunchedServer, launched_server
from radixserve.http_server.app import HttpServer, bind, build_app
from radixserve.http_server.bounded_head import MAX_HEAD_BYTES
from radixserve.protocol.internal import HealthReq, TokenizedGenerateReq
from radixserve.protocol.wire import ServerInfoReply

GREEDY = {"temperature": 0, "max_new_tokens": 8}
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_served_model) -> Iterator[LaunchedServer]:
    flags = ("--model", str(tiny_served_model), "--max-total-tokens", "8192")
    with launched_server(*flags, "--check-invariants") as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.http_url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def zmq_client(server) -> Iterator[Client]:
    with Client(server.address, timeout=600) as c:
        yield c


def test_completions_equal_the_zmq_clients_greedy_text(oai, model, zmq_client):
    prompt = "The capital of France is"
    want = zmq_client.generate(prompt, sampling_params=GREEDY)
    got = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    (choice,) = got.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 8
    assert got.usage.prompt_tokens == want.meta_info.prompt_tokens

    # Token ids and a list of prompts: one choice per prompt, in order.
    ids = zmq_client.generate("Once upon", sampling_params=GREEDY)
    both = oai.completions.create(
        model=model, prompt=[prompt, "Once upon"], max_tokens=8, temperature=0
    )
    assert [c.text for c in both.choices] == [want.text, ids.text]
    by_ids = oai.completions.create(
        model=model, prompt=want.output_ids[:3], max_tokens=4, temperature=0
    )
    from_ids = zmq_client.generate(
        input_ids=want.output_ids[:3], sampling_params={**GREEDY, "max_new_tokens": 4}
    )
    assert by_ids.choices[0].text == from_ids.text


def test_chat_streamed_and_not_equals_the_zmq_clients(oai, model, zmq_client):
    want = zmq_client.generate(messages=CHAT, sampling_params=GREEDY).text
    whole = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"

    stream = oai.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage  # include_usage: a last chunk with usage and no choices
    assert not chunks[-1].choices and usage.completion_tokens == 8
    # The same conversation again: its prompt comes from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_n_seed_stop_and_logprobs(oai, model, zmq_client):
    two = oai.completions.create(
        model=model, prompt="Hello", n=2, seed=3, temperature=1.0, max_tokens=8
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    assert two.usage.completion_tokens == 16

    prompt = "Tell me"
    free = zmq_client.generate(prompt, sampling_params={**GREEDY, "max_new_tokens": 12}).text
    stop = free[len(free) // 2 :][:2]  # a piece from the middle of the free text
    stopped = oai.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=stop
    )
    text = stopped.choices[0].text
    assert free.startswith(text) and stop not in text and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == stop  # SGLang's field

    want = zmq_client.generate(prompt, sampling_params=GREEDY, return_logprob=True)
    got = oai.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2
    )
    logprobs = got.choices[0].logprobs
    expected = want.meta_info.output_token_logprobs
    assert logprobs.token_logprobs == pytest.approx([lp for lp, _ in expected])
    assert "".join(logprobs.tokens) == want.text
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)

    chat = oai.chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy


def test_errors_have_openais_shape_and_status(oai, model, server):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", temperature=-1)
    assert "temperature" in str(e.value)
    bad = httpx.post(f"{server.http_url}/v1/chat/completions", json={"model": model, "x": 1})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error" and "`x`" in error["message"]
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    json_type = {"Content-Type": "application/json"}
    nested = httpx.post(f"{server.http_url}/v1/completions", content=deep, headers=json_type)
    assert nested.status_code == 400 and "nested" in nested.json()["error"]["message"]
    surrogate = b'"\xed\xa0\x80"'  # not UTF-8: a lone surrogate's bytes
    for path, body in (  # each was a plain 500
        ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": ' + surrogate + b"}"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": ' + surrogate + b"}]}",
        ),
        ("/generate", b'{"text": ' + surrogate + b"}"),
    ):
        bad = httpx.post(f"{server.http_url}{path}", content=body, headers=json_type)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    too_long = httpx.post(
        f"{server.http_url}/generate", json={"input_ids": [5] * 2000, "stream": True}
    )
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "maximum context length" in error["message"]


def test_native_endpoints(server, zmq_client):
    # "radixserve ready" follows the manager's own: a client starting on it is never not_ready.
    log = server.log()
    assert log.index("The model is ready: taking requests") < log.index("radixserve ready")
    url = server.http_url
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    whole = httpx.post(f"{url}/generate", json=body).json()
    assert whole["text"] == zmq_client.generate(**body).text and whole["finished"]

    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == whole["text"]

    assert httpx.get(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["is_generation"] is True and info["tokenizer_path"] == info["model_path"]
    # Every field, those at their defaults too (dp_rank 0, spec_verifies 0): a JSON reader
    # has no struct to fill them in.
    server_info = httpx.get(f"{url}/get_server_info").json()
    assert set(server_info) == {"type", *ServerInfoReply.__struct_fields__}
    assert httpx.post(f"{url}/flush_cache").json() == {"success": True, "message": ""}


def test_what_sglang_clients_send_to_generate(server):
    """SGLang's bench_serving and RuntimeEndpoint send these with every request: its nulls, its
    no-op fields, one stop string as a string, sampling_seed. Each is taken as SGLang takes it
    (the same tokens as our own spelling); a value asking for what is not here is a 400 naming
    the field. The reply carries meta_info.id, SGLang's place for the rid."""
    url = server.http_url
    ours = {"text": "Tell me", "sampling_params": {**GREEDY, "max_new_tokens": 12}}
    free = httpx.post(f"{url}/generate", json=ours).json()
    stop = free["text"][len(free["text"]) // 2 :][:2]
    sglang = {
        "text": "Tell me",
        "rid": "sg-1",
        "lora_path": None,
        "image_data": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "return_text_in_logprobs": False,
        "stream": False,
        "sampling_params": {
            **GREEDY,
            "max_new_tokens": 12,
            "stop": stop,
            "spaces_between_special_tokens": True,
            "no_stop_trim": False,
            "stop_regex": [],
            "sampling_seed": None,
            "top_k": None,
        },
    }
    reply = httpx.post(f"{url}/generate", json=sglang)
    assert reply.status_code == 200, reply.text
    stopped = httpx.post(
        f"{url}/generate",
        json={**ours, "sampling_params": {**ours["sampling_params"], "stop": [stop]}},
    ).json()
    assert reply.json()["text"] == stopped["text"] and reply.json()["meta_info"]["id"] == "sg-1"
    seeded = {"text": "Hi", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0}}
    by_name = {**seeded, "sampling_params": {**seeded["sampling_params"], "sampling_seed": 5}}
    ours_seed = {**seeded, "sampling_params": {**seeded["sampling_params"], "seed": 5}}
    assert (
        httpx.post(f"{url}/generate", json=by_name).json()["output_ids"]
        == (httpx.post(f"{url}/generate", json=ours_seed).json()["output_ids"])
    )
    # A null sampling field is its default, as a field left out is (with a model's defaults:
    # tests/test_sampling_defaults.py); a null sampling_params too.
    nulls = {**seeded, "sampling_params": {"max_new_tokens": 6, "temperature": None, "seed": 5}}
    left_out = {**seeded, "sampling_params": {"max_new_tokens": 6, "seed": 5}}
    assert (
        httpx.post(f"{url}/generate", json=nulls).json()["output_ids"]
        == (httpx.post(f"{url}/generate", json=left_out).json()["output_ids"])
    )
    assert httpx.post(f"{url}/generate", json={"text": "Hi", "sampling_params": None}).is_success
    refused = httpx.post(f"{url}/generate", json={**ours, "lora_path": "adapter"})
    assert refused.status_code == 400 and "lora_path" in refused.json()["error"]["message"]


def test_state_changes_are_post_only_and_bodies_json_only(server, model):
    """What a web page could send to 127.0.0.1 without the browser asking first (a GET, a form,
    text/plain) changes nothing and starts nothing."""
    url = server.http_url
    assert httpx.get(f"{url}/flush_cache").status_code == 405
    body = json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 1}})
    before = _metrics(url)["radixserve:num_requests_total"]
    for kind in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {"Content-Type": kind} if kind else {}
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            refused = httpx.post(f"{url}{path}", content=body, headers=headers)
            assert refused.status_code == 415, (kind, path, refused.text)
            assert refused.json()["error"]["code"] == "unsupported_media_type"
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(f"{url}/generate", content=body, headers=charset).status_code == 200
    assert _metrics(url)["radixserve:num_requests_total"] == before + 1


@pytest.mark.parametrize("prompts", [1, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_request_aborted(server, model, stream, prompts):
    """Streamed or not, its KV is freed at once, long before the 1,000 tokens it asked for (a
    request not streamed sends nothing until its end: only the connection's close tells); each
    of several prompts' too (the disconnect's task, cancelled as it sent the first's abort, once
    left the others running)."""
    url = server.http_url
    prompt = "Go on" if prompts == 1 else [f"Go on {i}" for i in range(prompts)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True}
    request = json.dumps({**body, "stream": stream}).encode()
    before = _metrics(url)
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(request)}\r\n"
        sock.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + request)
        if stream:
            received = b""
            while received.count(b"data: ") < 3:  # three tokens streamed: it runs
                received += sock.recv(65536)
        else:
            _wait_for(url, lambda info: info["running_requests"] == prompts)
        assert httpx.get(f"{url}/get_server_info").json()["running_requests"] == prompts
    _wait_for(url, lambda info: info["running_requests"] == 0)
    after = _metrics(url)
    aborted = "radixserve:num_aborted_requests_total"
    assert after[aborted] == before[aborted] + prompts
    generated = "radixserve:generation_tokens_total"
    assert after[generated] - before[generated] < 100 * prompts
    # Nothing holds KV any more: the cache can be emptied, and then no slot is in use.
    assert httpx.post(f"{url}/flush_cache").json()["success"]
    assert httpx.get(f"{url}/get_server_info").json()["kv_tokens_used"] == 0


def _wait_for(url: str, condition: Callable[[dict], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition(httpx.get(f"{url}/get_server_info").json()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_metrics_parse_and_move_under_load(server, oai, model):
    url = server.http_url
    before = _metrics(url)
    for _ in range(3):
        oai.completions.create(
            model=model, prompt="Count", max_tokens=5, temperature=0, stream=False
        )
    list(oai.completions.create(model=model, prompt="Count", max_tokens=5, stream=True))
    after = _metrics(url)
    assert after["radixserve:num_requests_total"] == before["radixserve:num_requests_total"] + 4
    assert (
        after["radixserve:generation_tokens_total"]
        >= before["radixserve:generation_tokens_total"] + 20
    )
    assert after["radixserve:prompt_tokens_total"] > before["radixserve:prompt_tokens_total"]
    ttft = "radixserve:time_to_first_token_seconds_count"
    assert after[ttft] == before.get(ttft, 0) + 1  # the streamed one
    assert "radixserve:num_running_reqs" in after and "radixserve:token_usage" in after
    # A load balancer's probe is no client's request (SGLang's log_metrics=False).
    for _ in range(2):
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    probed = _metrics(url)
    for name in ("num_requests", "generation_tokens", "prompt_tokens"):
        assert probed[f"radixserve:{name}_total"] == after[f"radixserve:{name}_total"], name


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_api_key_and_body_limit(tiny_served_model):
    """The app in-process over the tokenizer manager alone (tm_harness plays the scheduler):
    without `Authorization: Bearer KEY` nothing reaches the scheduler; a body over
    --max-request-bytes is refused before it is read whole."""
    key = "s3cret"

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, api_key=key, max_request_bytes=4096) as h:
            app = build_app(h.manager)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                body = {"model": str(tiny_served_model), "prompt": "Hi", "max_tokens": 2}
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    r = await http.post("/v1/completions", json=body, headers=headers)
                    assert r.status_code == 401
                    assert r.json()["error"]["type"] == "authentication_error"
                for path in ("/v1/models", "/get_server_info", "/metrics"):
                    assert (await http.get(path)).status_code == 401
                assert not await h.scheduler.poll(100)  # nothing ran, nothing was queued
                good = {"Authorization": f"Bearer {key}"}
                big = {**body, "prompt": "x" * 5000}
                r = await http.post("/v1/completions", json=big, headers=good)
                assert r.status_code == 413
                assert not await h.scheduler.poll(100)
                health = asyncio.create_task(http.get("/health"))  # needs no key
                assert isinstance(await h.to_scheduler(), HealthReq)
                health.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_openai_request_holds_its_place_in_the_intake_while_it_is_tokenized(
    tiny_served_model, path
):
    """The OpenAI API tokenizes before it submits: while one client's long prompt is in the
    tokenizer (seconds), its next request is refused at once (503, the per-client cap), as on
    the ZMQ path; the long one then reaches the scheduler and the intake is empty again."""
    caps = {"max_pending_requests_per_client": 1, "context_length": 1_000_000}

    def body(text: str) -> dict:
        if path == "/v1/completions":
            return {"model": str(tiny_served_model), "prompt": text, "max_tokens": 1}
        messages = [{"role": "user", "content": text}]
        return {"model": str(tiny_served_model), "messages": messages, "max_tokens": 1}

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, max_request_bytes=10**7, **caps) as h:
            transport = httpx.ASGITransport(app=build_app(h.manager))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                long = asyncio.create_task(http.post(path, json=body("word " * 400_000)))
                for _ in range(1000):  # its body is read and held (10 s at most)
                    # (Once submitted, its place counts 32 bytes an id: 12.8 MB.)
                    if 2_000_000 < h.manager.intake.total.nbytes < 3_000_000:
                        break
                    await asyncio.sleep(0.01)
                refused = await asyncio.wait_for(http.post(path, json=body("Hi")), 30)
                assert refused.status_code == 503, refused.text
                error = refused.json()["error"]
                assert "--max-pending-requests-per-client" in error["message"]
                sent = await h.to_scheduler(timeout=120)
                assert len(sent.input_ids) > 10**5
                assert h.manager.intake.total.requests == 0
                long.cancel()

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def http_on_socket(manager) -> AsyncIterator[str]:
    """The HTTP server as the tokenizer manager's process runs it (uvicorn on its loop, a real
    socket), over a tm_harness manager: its base URL."""
    server = HttpServer(manager, bind("127.0.0.1", 0))
    port = server.sock.getsockname()[1]
    task = asyncio.create_task(server.run_on_loop())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _status_line(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readline(), 10)


def test_a_body_that_never_comes_gives_back_its_place(tiny_served_model):
    """A body counts against the intake's caps from its headers on: two that never arrive held
    the client's two places for good, and everyone at its address (a proxy's clients) was
    refused. Past --http-body-timeout they are answered 408 and their places come back."""

    async def scenario() -> None:
        caps = {"max_pending_requests_per_client": 2, "http_body_timeout": 3.0}
        async with (
            tokenizer_manager(tiny_served_model, **caps) as h,
            http_on_socket(h.manager) as url,
        ):
            port = int(url.rsplit(":", 1)[1])
            head = (
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro'
            )
            stalled = []
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head)
                stalled.append((reader, writer))
            body = {"model": str(tiny_served_model), "prompt": "Hi", "max_tokens": 1}
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                while h.manager.intake.total.requests < 2:
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json=body)
                assert refused.status_code == 503, refused.text
                for reader, writer in stalled:
                    assert (await _status_line(reader)).startswith(b"HTTP/1.1 408"), "no 408"
                    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).lower()
                    assert b"connection: close" in head  # mid-body: no further request on it
                    writer.close()
                served = asyncio.create_task(http.post("/v1/completions", json=body))
                assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)
                served.cancel()

    asyncio.run(scenario())


def test_a_client_leaving_mid_body_logs_no_traceback(tiny_served_model, caplog):
    """Starlette's ClientDisconnect escaped the handler: ~45 lines of traceback a time, which
    any client could repeat into the log."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h, http_on_socket(h.manager) as url:
            port = int(url.rsplit(":", 1)[1])
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
                )
                await writer.drain()
                while h.manager.intake.total.requests == 0:
                    await asyncio.sleep(0.01)
                writer.close()
                while h.manager.intake.total.requests:  # its place given back
                    await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.exc_info], caplog.text[:2000]


def test_a_huge_head_is_refused_before_it_is_read_whole(tiny_served_model):
    """httptools bounds no header, and builds one by `bytes +=`: a header of 160 MiB held the
    loop that ZMQ clients share for seconds. A head over MAX_HEAD_BYTES is a 431, at once, and
    the server goes on serving."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h, http_on_socket(h.manager) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: ")
            for _ in range(4):  # in pieces, as a client writes them: past the bound, dropped
                writer.write(b"a" * MAX_HEAD_BYTES)
                await writer.drain()
            reply = await asyncio.wait_for(reader.read(), 10)
            assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_large"
            writer.close()
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                big_but_fine = {"X-Fine": "b" * (MAX_HEAD_BYTES // 2)}
                assert (await http.get("/v1/models", headers=big_but_fine)).status_code == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_run_on_as_the_whole_answers(server, model, echo):
    """A streamed completion's `text_offset` restarted at 0 in every chunk; it runs on through
    the choice's text (the echoed prompt's too, whose logprobs come in the last chunk)."""
    url = f"{server.http_url}/v1/completions"
    body = {"model": model, "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    body |= {"logprobs": 2, "echo": echo}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]
    streamed = []
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    logprobs = choice["logprobs"] or {"text_offset": [], "tokens": []}
                    streamed += zip(logprobs["text_offset"], logprobs["tokens"])
    assert len(streamed) > 6 if echo else len(streamed) == 6
    assert sorted(streamed) == sorted(zip(whole["text_offset"], whole["tokens"]))


def test_logprobs_of_tokens_a_grammar_rules_out_are_numbers(server, model):
    """Their logprob is -inf, which JSON wrote as null; OpenAI's is always a number, and vLLM
    sends -9999.0."""
    completion = {"model": model, "prompt": "Answer:", "regex": "(yes|no)", "max_tokens": 5}
    completion |= {"logprobs": 3, "temperature": 0}
    r = httpx.post(f"{server.http_url}/v1/completions", json=completion, timeout=60)
    tops = [v for top in r.json()["choices"][0]["logprobs"]["top_logprobs"] for v in top.values()]
    assert all(isinstance(v, float) for v in tops) and min(tops) == -9999.0
    chat = {"model": model, "messages": CHAT, "regex": "(yes|no)", "max_tokens": 5}
    chat |= {"logprobs": True, "top_logprobs": 3, "temperature": 0}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=chat, timeout=60)
    content = r.json()["choices"][0]["logprobs"]["content"]
    tops = [alt["logprob"] for entry in content for alt in entry["top_logprobs"]]
    assert all(isinstance(v, float) for v in tops) and min(tops) == -9999.0


def test_health_says_no_while_the_server_drains(tiny_served_model):
    """After SIGTERM new generates get 503, but /health said 200: a load balancer went on
    sending the server what it refused. Over ZMQ health is an `overloaded` error too."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            transport = httpx.ASGITransport(app=build_app(h.manager))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                h.manager.admission.accepting = False  # what shutdown() does first
                r = await http.get("/health")
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert "shutting down" in r.json()["error"]["message"]
            client = h.client()
            await client.send(msgspec.msgpack.encode({"type": "health"}))
            reply = msgspec.msgpack.decode(await asyncio.wait_for(client.recv(), 10))
            assert reply["type"] == "error" and reply["code"] == "overloaded", reply

    asyncio.run(scenario())
