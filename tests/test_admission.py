"""Before the scheduler: the tokenizer manager refuses what it cannot serve yet (`not_ready` while
the model loads), answers control queries in bounded time, and caps what waits for the
scheduler. The manager over its real sockets; the test plays the scheduler (tm_harness.py)."""

from __future__ import annotations

import asyncio

import msgspec
from tm_harness import generate, receive, send, tokenizer_manager

from radixserve.protocol.internal import HealthOut, HealthReq, TokenizedGenerateReq


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
