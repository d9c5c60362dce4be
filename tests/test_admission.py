"""Before the scheduler: the tokenizer manager refuses what it cannot serve yet (`not_ready` while
the model loads), answers control queries in bounded time, and caps what waits for the
scheduler. The manager over its real sockets; the test plays the scheduler (tm_harness.py)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import msgspec
import pytest
from tm_harness import generate, receive, send, tokenizer_manager

from radixserve.protocol.internal import (
    DetokenizerReady,
    HealthOut,
    HealthReq,
    LauncherInput,
    ProcessReady,
    SchedulerReady,
    TokenizedGenerateReq,
)
from radixserve.protocol.wire import GenerateRequest
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.intake import Intake
from radixserve.tokenizer_manager.process import report_when_ready
from radixserve.tokenizer_manager.request_decoder import ClientError


def test_until_the_model_is_ready_requests_get_not_ready_with_their_rid(tiny_served_model):
    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, ready=False) as h:
            client = h.client()
            await send(client, **generate("early"))
            reply = await receive(client)
            assert (reply["type"], reply["code"], reply["rid"]) == ("error", "not_ready", "early")
            await send(client, type="health")
            assert (await receive(client))["code"] == "not_ready"
            assert not await h.scheduler.poll(100)  # nothing was held for the scheduler

            await h.announce_ready()
            await send(client, **generate("later"))
            assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)

    asyncio.run(scenario())


def test_a_model_loaded_before_the_detokenizer_is_not_ready_yet(tiny_served_model):
    """A slow tokenizer's detokenizer loads it through transformers, which can take longer than
    a small model's load: until it can turn tokens into text, generates and health checks get
    `not_ready` (503 over HTTP), as while the model loads."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, ready=False) as h:
            client = h.client()
            await h.backend.send(msgspec.msgpack.encode(SchedulerReady(0, max_total_tokens=64)))
            await send(client, type="health")
            assert (await receive(client))["code"] == "not_ready"
            await send(client, **generate("early"))
            assert (await receive(client))["code"] == "not_ready"
            assert not h.manager.model_ready.is_set()

            await h.backend.send(msgspec.msgpack.encode(DetokenizerReady()))
            await asyncio.wait_for(h.manager.model_ready.wait(), 5)
            await send(client, **generate("later"))
            assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)

    asyncio.run(scenario())


def test_the_manager_tells_the_launcher_it_is_ready_only_once_the_model_is(tiny_served_model):
    """launch.py logs "radixserve ready" once every child has reported: the manager's report
    waits for the scheduler's (and the detokenizer's), so that a client starting on that line
    never meets `not_ready`."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, ready=False) as h:
            reader, writer = mp.get_context("spawn").Pipe(duplex=False)
            reporting = asyncio.create_task(report_when_ready(h.manager, writer))
            await asyncio.sleep(0.3)  # the manager's loops are serving, the model is not loaded
            assert not reader.poll() and not reporting.done()

            await h.announce_ready()
            await asyncio.wait_for(reporting, 5)
            report = msgspec.msgpack.decode(reader.recv_bytes(), type=LauncherInput)
            assert report == ProcessReady("tokenizer_manager")

    asyncio.run(scenario())


def test_a_request_is_timed_from_when_it_came_whole(tiny_served_model):
    """The HTTP front submits the OpenAI API's requests after tokenizing them: their clock
    (TTFT, latency, --log-requests' e2e) starts when each came whole, as vLLM's and SGLang's."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.manager.open_local_client()
            arrived = time.monotonic() - 2.0
            request = GenerateRequest(rid="timed", input_ids=[1, 2, 3])
            await h.manager.submit([client.peer], request, arrived)
            assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)
            (registered,) = h.manager.inflight.of_peer(client.peer)
            assert registered.created == arrived

    asyncio.run(scenario())


def test_a_control_query_the_scheduler_leaves_unanswered_gets_overloaded(tiny_served_model):
    """A scheduler in a long step answers late: the client hears `overloaded` at the timeout,
    and the late answer goes nowhere; a query answered in time gets its answer."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            h.manager.query_timeout_s = 0.3
            client = h.client()
            await send(client, type="health")
            late = await h.to_scheduler()
            assert isinstance(late, HealthReq)
            reply = await receive(client)
            assert (reply["type"], reply["code"]) == ("error", "overloaded")
            await h.backend.send(msgspec.msgpack.encode(HealthOut(late.query_id)))

            await send(client, type="health")
            query = await h.to_scheduler()
            await h.backend.send(msgspec.msgpack.encode(HealthOut(query.query_id)))
            assert (await receive(client))["type"] == "health"
            assert not await client.poll(100)  # the late answer reached no one
            assert not h.manager.pending_queries

    asyncio.run(scenario())


def test_the_intake_caps_each_client_and_all_of_them_in_requests_and_bytes():
    intake = Intake(
        ServerArgs(
            max_pending_requests=3,
            max_pending_bytes=1000,
            max_pending_requests_per_client=2,
            max_pending_bytes_per_client=600,
        )
    )
    a1 = intake.take("a", 100)
    a2 = intake.take("a", 100)
    with pytest.raises(ClientError, match="this client's") as refused:
        intake.take("a", 1, rid="r")  # a's third request
    assert (refused.value.code, refused.value.rid) == ("overloaded", "r")
    b1 = intake.take("b", 700)  # over a client's bytes, but b has nothing waiting: let in
    with pytest.raises(ClientError, match="this client's"):
        intake.take("b", 1)  # b's bytes are over its cap now
    with pytest.raises(ClientError, match="all clients'"):
        intake.take("c", 1)  # three wait in all
    a1.release()
    a1.release()  # once only
    with pytest.raises(ClientError, match="all clients'"):
        intake.take("c", 201)  # 800 bytes wait: 201 more pass the total
    c1 = intake.take("c", 100)
    with pytest.raises(ClientError, match="all clients'"):
        c1.grow(101)  # a body that arrives in chunks counts as it comes
    c1.grow(100)
    assert intake.by_client["c"].nbytes == 200 and intake.total.nbytes == 1000
    for ticket in (a2, b1, c1):
        ticket.release()
    assert intake.total.requests == intake.total.nbytes == 0 and not intake.by_client


def test_a_client_past_its_cap_gets_overloaded_while_others_are_admitted(tiny_served_model):
    """While one client's long prompt is in the tokenizer (seconds), its next generate is
    refused at once with its rid; another client's goes through."""

    async def scenario() -> None:
        caps = {"max_pending_requests_per_client": 1, "context_length": 1_000_000}
        async with tokenizer_manager(tiny_served_model, **caps) as h:
            busy, other = h.client(), h.client()
            await send(busy, type="generate", rid="long", text="word " * 400_000)
            await send(busy, **generate("second"))
            reply = await receive(busy)
            assert (reply["code"], reply["rid"]) == ("overloaded", "second")
            assert "--max-pending-requests-per-client" in reply["message"]
            await send(other, **generate("other"))
            first = await h.to_scheduler(timeout=120)
            assert isinstance(first, TokenizedGenerateReq) and len(first.input_ids) < 10
            long = await h.to_scheduler(timeout=120)
            assert len(long.input_ids) > 10**5
            assert h.manager.intake.total.requests == 0

    asyncio.run(scenario())
