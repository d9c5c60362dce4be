"""The client against a fake ROUTER server over real TCP: framing, routing, errors, timeouts.

The fake answers like radixserve but generates nothing; the real server is tested end to end
elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import itertools
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from radixserve.client import AsyncClient, Client, ProtocolError, ServerError
from radixserve.client.cli import main
from radixserve.client.local_server import free_port
from radixserve.client.messages import WireCodec
from radixserve.protocol.wire import (
    AbortRequest,
    ClientRequest,
    ErrorReply,
    FinishReason,
    FlushCacheReply,
    FlushCacheRequest,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    MetaInfo,
    ModelInfoReply,
    ModelInfoRequest,
    OutputReply,
    ServerInfoReply,
    ServerInfoRequest,
    ServerReply,
)

SERVER_INFO = ServerInfoReply(
    running_requests=1,
    waiting_requests=2,
    kv_tokens_used=30,
    kv_tokens_total=4096,
    cache_hit_rate=0.5,
    gen_throughput=12.5,
    num_steps=7,
    num_mixed_steps=1,
    num_retractions=0,
    num_evicted_tokens=0,
    num_prefill_tokens=0,
    max_running_requests=8,
)
MODEL_INFO = ModelInfoReply(
    model_path="/models/fake",
    architecture="FakeForCausalLM",
    context_length=2048,
    vocab_size=100,
    dtype="float32",
    is_generation=True,
    tokenizer_path="/models/fake",
)
SPLIT = 5  # a streamed echo comes as text[:SPLIT] and then text[SPLIT:]


def echo(request: GenerateRequest) -> str:
    if request.text is not None:
        prompt = request.text
    elif request.messages is not None:
        prompt = "|".join(f"{m.role}:{m.content}" for m in request.messages)
    else:
        prompt = ",".join(map(str, request.input_ids or []))
    return f"echo:{prompt}"


class FakeServer:
    """A ROUTER in a thread that answers each request like radixserve would, from canned data.

    Prompts with a meaning: "boom" gets an error with its rid, "anonymous" an error without one,
    "hang" nothing at all. Replies go out after a random few milliseconds, so concurrent
    requests' replies interleave.
    """

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.address.rsplit(":", 1)[1])
        self.busy = False  # flush_cache is refused while "requests run"
        self.frames: list[list[bytes]] = []
        self.raw_requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self._decoder = msgspec.msgpack.Decoder(ClientRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._due: list[tuple[float, int, list[bytes]]] = []  # (send at, seq, frames)
        self._seq = itertools.count()
        self._rng = random.Random(0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            wait_ms = 20 if not self._due else max(0, (self._due[0][0] - time.monotonic()) * 1e3)
            if self.sock.poll(min(20, int(wait_ms))):
                frames = self.sock.recv_multipart()
                self.frames.append(frames)
                # Keep the envelope: identity, and a REQ client's empty delimiter.
                self._answer(frames[:-1], frames[-1])
            while self._due and self._due[0][0] <= time.monotonic():
                self.sock.send_multipart(heapq.heappop(self._due)[2])

    def _answer(self, envelope: list[bytes], payload: bytes) -> None:
        def reply(msg: ServerReply, delay: float = 0.0) -> None:
            frames = [*envelope, self._encoder.encode(msg)]
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._seq), frames))

        try:
            self.raw_requests.append(msgspec.msgpack.decode(payload))
            request = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            return reply(ErrorReply(code="invalid_request", message=str(e)))
        if isinstance(request, GenerateRequest):
            delay = 0.0
            for msg in self._generate(request):
                delay += self._rng.uniform(0, 0.01)  # in order within a request only
                reply(msg, delay)
        elif isinstance(request, AbortRequest):
            self.aborted.append(request.rid)
        elif isinstance(request, HealthRequest):
            reply(HealthReply("ok"))
        elif isinstance(request, ServerInfoRequest):
            reply(SERVER_INFO)
        elif isinstance(request, ModelInfoRequest):
            reply(MODEL_INFO)
        elif isinstance(request, FlushCacheRequest):
            busy = ErrorReply(code="overloaded", message="requests are running")
            reply(busy if self.busy else FlushCacheReply(success=True))

    def _generate(self, request: GenerateRequest) -> list[ServerReply]:
        assert request.rid is not None
        if request.text == "hang":
            return []
        if request.text == "boom":
            return [ErrorReply(code="invalid_request", message="boom", rid=request.rid)]
        if request.text == "anonymous":
            return [ErrorReply(code="internal", message="who asked?")]
        text = echo(request)
        pieces = [text[:SPLIT], text[SPLIT:]] if request.stream else [text]
        n = request.sampling_params.n
        replies: list[ServerReply] = []
        for index, piece in itertools.product(range(n), range(len(pieces))):
            done = piece == len(pieces) - 1
            meta = MetaInfo(
                prompt_tokens=len(text),
                completion_tokens=2,
                cached_tokens=0,
                finish_reason=FinishReason(type="length") if done else None,
                e2e_latency=0.01,
            )
            replies.append(
                OutputReply(
                    rid=request.rid,
                    text=pieces[piece],
                    output_ids=[piece],
                    finished=done,
                    meta_info=meta,
                    index=index if n > 1 else None,
                )
            )
        return replies


def wait_until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
def client(server):
    with Client(server.address, timeout=5) as c:
        yield c


# ---- sync client --------------------------------------------------------------------------------


def test_generate_sends_one_frame_and_gets_one_reply(server, client):
    out = client.generate("hi", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out.text == "echo:hi" and out.finished
    assert len(out.rid) == 32  # uuid4 hex, made by the client
    assert out.meta_info.finish_reason == FinishReason(type="length")
    (frames,) = server.frames
    assert len(frames) == 2  # the ROUTER's identity frame, then the one msgpack map
    assert server.raw_requests == [
        {
            "type": "generate",
            "rid": out.rid,
            "text": "hi",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        }  # what the caller gave, and nothing else
    ]


def test_generate_from_ids_or_messages(client):
    assert client.generate(input_ids=[1, 2, 3], rid="mine").text == "echo:1,2,3"
    chat = client.generate(messages=[{"role": "user", "content": "yo"}])
    assert chat.text == "echo:user:yo"


def test_stream_yields_chunks_until_finished(client):
    chunks = list(client.stream("streaming", rid="s1"))
    assert [c.text for c in chunks] == ["echo:", "streaming"]
    assert [c.finished for c in chunks] == [False, True]
    assert {c.rid for c in chunks} == {"s1"}


def test_stream_with_n_ends_after_every_completion(client):
    chunks = list(client.stream("x", sampling_params={"n": 3}))
    assert sorted(c.index for c in chunks if c.finished) == [0, 1, 2]
    assert len(chunks) == 6


def test_two_open_streams_each_get_their_own_replies(client):
    a, b = client.stream("aaaaaa", rid="a"), client.stream("bbbbbb", rid="b")
    assert next(b).text == "echo:"
    assert next(a).text == "echo:"
    assert [c.text for c in b] == ["bbbbbb"]
    assert [c.text for c in a] == ["aaaaaa"]


def test_error_reply_raises_server_error(client):
    with pytest.raises(ServerError) as info:
        client.generate("boom", rid="bad")
    error = info.value
    assert (error.code, error.message, error.rid) == ("invalid_request", "boom", "bad")
    with pytest.raises(ServerError):
        list(client.stream("boom"))
    assert client.generate("fine").text == "echo:fine"  # the client is still usable


def test_anonymous_error_answers_the_waiting_call(client):
    with pytest.raises(ServerError) as info:
        client.generate("anonymous")
    assert info.value.code == "internal" and info.value.rid is None


def test_control_calls(server, client):
    assert client.health() == HealthReply(status="ok")
    assert client.server_info() == SERVER_INFO
    assert client.model_info() == MODEL_INFO
    assert client.flush_cache().success
    server.busy = True
    with pytest.raises(ServerError, match="overloaded"):
        client.flush_cache()


def test_an_api_key_goes_with_every_request(server, monkeypatch, capsys):
    """Client(api_key=...), AsyncClient's too, $RADIXSERVE_API_KEY, and radixserve-client's
    --api-key: a server run with --api-key would refuse them all without it."""
    with Client(server.address, api_key="k1") as client:
        client.generate("hi", rid="a")
        client.health()
        chunks = client.stream("long", rid="b")
        next(chunks)
        chunks.close()
        wait_until(lambda: server.aborted == ["b"])

    async def from_async() -> None:
        async with AsyncClient(server.address, api_key="k2") as client:
            await client.generate("hi")
            await client.server_info()

    asyncio.run(from_async())
    monkeypatch.setenv("RADIXSERVE_API_KEY", "k3")
    with Client(server.address) as client:
        client.flush_cache()
    assert main(["--port", str(server.port), "--health"]) == 0
    assert main(["--port", str(server.port), "--api-key", "k4", "--health"]) == 0
    capsys.readouterr()
    keys = [r.get("api_key") for r in server.raw_requests if r["type"] != "abort"]
    assert keys == ["k1", "k1", "k1", "k2", "k2", "k3", "k3", "k4"]
    aborts = [r for r in server.raw_requests if r["type"] == "abort"]
    assert aborts and all(r["api_key"] == "k1" for r in aborts)


def test_timeout_raises_and_aborts(server):
    with Client(server.address, timeout=0.2) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.generate("hang", rid="slow")
        assert time.monotonic() - start < 1.5
        wait_until(lambda: server.aborted == ["slow"])
        assert client.health().status == "ok"


def test_closing_a_stream_early_aborts_it(server, client):
    chunks = client.stream("long", rid="early")
    next(chunks)
    chunks.close()
    wait_until(lambda: server.aborted == ["early"])
    assert client.generate("next").text == "echo:next"  # the stale chunk is dropped


def test_a_stream_dropped_before_its_first_chunk_is_aborted(server, client):
    """The request goes out when stream() is called; a generator never started runs no
    `finally`, so one dropped unread ran on to max_new_tokens, its rid in use for good."""
    chunks = client.stream("long", rid="unread")
    del chunks
    gc.collect()
    wait_until(lambda: server.aborted == ["unread"])
    assert list(client.stream("x", rid="unread"))  # the rid is free again


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"sampling_params": {"temperature": -1}}, "temperature must be in [0, 1000000]"),
        # infinite, and 0, as the sampler's 32-bit floats
        ({"sampling_params": {"temperature": 1e39}}, "temperature must be in [0, 1000000]"),
        ({"sampling_params": {"repetition_penalty": 1e-50}}, "repetition_penalty must be in"),
        ({"sampling_params": {"top_p": 1e-50}}, "top_p must be in [1e-6, 1]"),
        ({"sampling_params": {"temprature": 1}}, "unknown field `temprature`"),
        ({"sampling_params": {"seed": 2**64}}, "serialize ints"),
        ({"input_ids": [1]}, "exactly one of text, input_ids or messages"),
        ({"text": None, "messages": [{"role": "robot", "content": "x"}]}, "$.messages[0].role"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_refused_requests_raise_server_error_before_sending(server, client, kwargs, names):
    """The server's code and message, from the client's own check: one error type to catch."""
    with pytest.raises(ServerError) as info:
        client.generate(**{"text": "x", **kwargs}, rid="mine")
    assert (info.value.code, info.value.rid) == ("invalid_request", "mine")
    assert names in info.value.message
    assert server.frames == []


def test_generate_of_n_completions_is_a_usage_error(server, client):
    with pytest.raises(ServerError, match="stream") as info:  # as the README promises
        client.generate("x", sampling_params={"n": 2}, rid="two")
    assert (info.value.code, info.value.rid) == ("invalid_request", "two")
    assert server.frames == []


def test_a_given_value_equal_to_the_default_is_sent(server, client):
    """The server gives a left-out field the model's default: 1.0 said must stay 1.0."""
    client.generate("x", sampling_params={"temperature": 1.0, "top_p": 1.0})
    assert server.raw_requests[-1]["sampling_params"] == {"temperature": 1.0, "top_p": 1.0}


def test_no_server_is_said_at_once_and_nothing_waits_forever():
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address, connect_timeout=0.3) as client:
        assert client.timeout is not None and client.connect_timeout is not None  # defaults
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=f"no server at {address}"):
            client.health()
        with pytest.raises(ConnectionError, match="no server"):
            client.generate("x")
        assert time.monotonic() - start < 3

    async def run() -> None:
        async with AsyncClient(address, connect_timeout=0.3) as client:
            assert client.timeout is not None and client.connect_timeout is not None
            with pytest.raises(ConnectionError, match=f"no server at {address}"):
                await client.generate("x")
            with pytest.raises(ConnectionError, match="no server"):
                await client.server_info()

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 3


def test_oversized_reply_is_a_protocol_error(server):
    with (
        Client(server.address, timeout=5, max_reply_bytes=16) as client,
        pytest.raises(ProtocolError, match="exceeds"),
    ):
        client.generate("a prompt long enough to make a reply over sixteen bytes")
    with pytest.raises(ProtocolError, match="undecodable"):
        WireCodec().decode(b"\x81\xa4type\xa4nope")


def test_req_socket_speaks_the_same_wire(server):
    """REQ adds an empty delimiter frame; the ROUTER keeps it in its replies."""
    codec = WireCodec()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.address)
    try:
        sock.send(codec.encode(HealthRequest()))
        assert codec.decode(sock.recv()) == HealthReply("ok")
        sock.send(codec.encode(GenerateRequest(rid="r", text="req")))
        out = codec.decode(sock.recv())
        assert isinstance(out, OutputReply) and out.text == "echo:req" and out.finished
        assert [len(f) for f in server.frames[0][1:]] == [0, len(codec.encode(HealthRequest()))]
    finally:
        sock.close()
        ctx.term()


# ---- async client -------------------------------------------------------------------------------


def test_async_concurrent_calls_are_routed_by_rid(server):
    async def run() -> None:
        async with AsyncClient(server.address, timeout=5) as client:

            async def one_stream(i: int) -> list[OutputReply]:
                return [c async for c in client.stream(f"stream-{i}", rid=f"s{i}")]

            calls = [client.generate(f"prompt-{i}", rid=f"g{i}") for i in range(8)]
            calls += [one_stream(i) for i in range(8)]
            calls += [client.health(), client.server_info(), client.model_info(), client.health()]
            results = await asyncio.gather(*calls)
            for i, out in enumerate(results[:8]):
                assert (out.rid, out.text) == (f"g{i}", f"echo:prompt-{i}")
            for i, chunks in enumerate(results[8:16]):
                assert [c.rid for c in chunks] == [f"s{i}"] * 2
                assert "".join(c.text for c in chunks) == f"echo:stream-{i}"
                assert [c.finished for c in chunks] == [False, True]
            assert results[16:] == [HealthReply("ok"), SERVER_INFO, MODEL_INFO, HealthReply("ok")]

    asyncio.run(run())
    assert len({frames[0] for frames in server.frames}) == 1  # all over one DEALER


def test_async_errors_timeouts_and_aborts(server):
    async def run() -> None:
        async with AsyncClient(server.address, timeout=0.2) as client:
            with pytest.raises(ServerError) as info:
                await client.generate("boom", rid="b")
            assert info.value.rid == "b"
            with pytest.raises(ServerError, match="internal"):
                await client.generate("anonymous")
            with pytest.raises(TimeoutError):
                await client.generate("hang", rid="slow")
            async with contextlib.aclosing(client.stream("long", rid="early")) as chunks:
                await anext(chunks)
            server.busy = True
            with pytest.raises(ServerError, match="overloaded"):
                await client.flush_cache()
            with pytest.raises(ServerError, match="stream"):
                await client.generate("x", sampling_params={"n": 2})
            with pytest.raises(ServerError, match="top_p"):
                await client.generate("x", sampling_params={"top_p": 0})
            assert (await client.generate("ok")).text == "echo:ok"

    asyncio.run(run())
    wait_until(lambda: server.aborted == ["slow", "early"])


def test_async_close_fails_waiting_calls(server):
    async def run() -> None:
        client = AsyncClient(server.address)
        waiting = asyncio.ensure_future(client.generate("hang"))
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(ConnectionError):
            await waiting

    asyncio.run(run())


# ---- command line -------------------------------------------------------------------------------


def test_cli_prints_a_completion(server, capsys):
    args = ["--port", str(server.port), "--max-new-tokens", "8", "--temperature", "0"]
    assert main([*args, "hello there"]) == 0
    assert capsys.readouterr().out == "echo:hello there\n"
    assert server.raw_requests[-1]["sampling_params"] == {"max_new_tokens": 8, "temperature": 0}

    assert main([*args, "--stream", "--chat", "--ignore-eos", "hi"]) == 0
    assert capsys.readouterr().out == "echo:user:hi\n"
    request = server.raw_requests[-1]
    assert request["stream"] and request["messages"] == [{"role": "user", "content": "hi"}]
    assert request["sampling_params"]["ignore_eos"] is True


def test_cli_sends_each_option_as_its_wire_field(server, capsys):
    args = ["--port", str(server.port), "--system", "Be brief.", "--stop", "!", "--stop", "."]
    args += ["--n", "2", "--seed", "7", "--top-logprobs", "3", "--min-p", "0.1", "hi"]
    assert main(args) == 0
    request = server.raw_requests[-1]
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert request["sampling_params"] == {"stop": ["!", "."], "n": 2, "seed": 7, "min_p": 0.1}
    assert request["return_logprob"] and request["top_logprobs_num"] == 3
    out = capsys.readouterr().out
    assert out.startswith("===== completion 0 =====\necho:system:Be brief.|user:hi\n")
    assert "===== completion 1 =====" in out


def test_cli_prints_control_replies_as_json(server, capsys):
    assert main(["--port", str(server.port), "--health"]) == 0
    assert json.loads(capsys.readouterr().out) == {"type": "health", "status": "ok"}
    assert main(["--port", str(server.port), "--server-info"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_tokens_total"] == 4096
    assert main(["--port", str(server.port), "--model-info"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "FakeForCausalLM"


def test_cli_stops_quietly_when_its_reader_goes(server, monkeypatch, capsys):
    """`radixserve-client ... | head`: the pipe's reader leaves. That printed "error: [Errno
    32] Broken pipe" and exited 1; tools stop quietly (128 + SIGPIPE)."""
    for streamed in (["--stream"], []):  # not streamed: all of it at once, buffered
        read_end, write_end = os.pipe()
        os.close(read_end)
        with open(write_end, "w") as gone:
            monkeypatch.setattr(sys, "stdout", gone)
            assert main(["--port", str(server.port), *streamed, "hello"]) == 141
    assert capsys.readouterr().err == ""


def test_cli_reports_errors(server, capsys):
    assert main(["--port", str(server.port), "boom"]) == 1
    assert "invalid_request: boom" in capsys.readouterr().err
    assert main(["--port", str(server.port), "--timeout", "0.1", "hang"]) == 1
    assert "no reply" in capsys.readouterr().err
    assert main(["--port", str(server.port), "--temperature", "-1", "x"]) == 1
    assert "invalid_request: temperature must be in [0, 1000000]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--port", str(server.port)])
