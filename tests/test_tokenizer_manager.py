"""The tokenizer manager alone, over its real sockets (tm_harness.py): the test plays the scheduler
and the detokenizer, so that it can order their messages as a race would."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import msgspec
import pytest
import zmq
from tm_harness import Harness, generate, receive, send, tokenizer_manager

from radixserve.protocol.internal import (
    AbortReq,
    HealthOut,
    HealthReq,
    ReqError,
    TokenizedGenerateReq,
)
from radixserve.protocol.wire import MAX_OUTPUT_TOP_LOGPROBS, FinishReason

STOP = FinishReason("stop", "S")
LENGTH = FinishReason("length")


def test_a_reused_rid_never_reaches_the_old_completion(tiny_served_model):
    """The race of issue 13: a request ends (on a stop string) while the scheduler still runs it
    for a moment, and its client at once sends a new request under the same rid. The scheduler
    must see two different ids, so that the old one's stop, late tokens and an abort of the new
    one each reach only their own completion."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client()
            await send(client, **generate("x", stop=["S"], max_new_tokens=50))
            first = await h.to_scheduler()
            await h.output(first.rid, [5, 6], STOP)
            assert (await receive(client))["meta_info"]["finish_reason"]["type"] == "stop"

            await send(client, **generate("x", max_new_tokens=4))
            second = await h.to_scheduler()
            assert isinstance(second, TokenizedGenerateReq)
            assert second.rid != first.rid  # the scheduler can tell them apart

            await h.output(first.rid, [7, 8])  # the old completion's late tokens
            await h.output(second.rid, [9])
            reply = await receive(client)
            assert reply["output_ids"] == [9] and reply["rid"] == "x"

            await send(client, type="abort", rid="x")
            assert await h.to_scheduler() == AbortReq(second.rid)

    asyncio.run(scenario())


def test_clients_have_their_own_rids(tiny_served_model):
    """Two clients may use the same rid; one's abort never touches the other's request."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            alice, bob = h.client(), h.client()
            await send(alice, **generate("same"))
            alices = await h.to_scheduler()
            await send(bob, **generate("same"))
            bobs = await h.to_scheduler()
            assert isinstance(bobs, TokenizedGenerateReq) and bobs.rid != alices.rid
            await send(bob, type="abort", rid="same")
            assert await h.to_scheduler() == AbortReq(bobs.rid)
            # Within one client a rid is still unique while in flight.
            await send(alice, **generate("same"))
            reply = await receive(alice)
            assert reply["type"] == "error" and "already in flight" in reply["message"]

    asyncio.run(scenario())


def test_output_top_logprobs_are_bounded_over_all_n_completions(tiny_served_model):
    """The scheduler sees each of n completions alone: n x max_new_tokens x top_logprobs_num is
    refused here, naming the field, before any completion starts; just inside is sent on."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client()
            per_completion = MAX_OUTPUT_TOP_LOGPROBS // 256 // 4  # within the bound alone
            body = generate("many", n=4, max_new_tokens=per_completion + 1)
            await send(client, **body, return_logprob=True, top_logprobs_num=256)
            reply = await receive(client)
            assert reply["type"] == "error" and reply["code"] == "invalid_request"
            assert (
                reply["message"].startswith("top_logprobs_num")
                and "4 completions" in reply["message"]
            )
            body = generate("fits", n=4, max_new_tokens=per_completion)
            await send(client, **body, return_logprob=True, top_logprobs_num=256)
            assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)

    asyncio.run(scenario())


def test_an_abort_said_again_sends_nothing_more(tiny_served_model):
    """Each abort of a request still winding down sent its n aborts again, and the scheduler
    searches its queues for each: a few bytes a frame bought n scans."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client()
            await send(client, **generate("four", n=4))
            sent = [await h.to_scheduler() for _ in range(4)]
            assert all(isinstance(m, TokenizedGenerateReq) for m in sent)
            for _ in range(3):
                await send(client, type="abort", rid="four")
            aborts = [await h.to_scheduler() for _ in range(4)]
            assert sorted(aborts, key=lambda a: a.rid) == [AbortReq(m.rid) for m in sent]
            assert not await h.scheduler.poll(300)  # the two repeats sent nothing

    asyncio.run(scenario())


def test_a_client_that_went_away_has_its_requests_aborted(tiny_served_model):
    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client()
            await send(client, **generate("gone"))
            started = await h.to_scheduler()
            await h.output(started.rid, [5])
            assert (await receive(client))["output_ids"] == [5]
            client.close()
            # Its next outputs find it gone (EHOSTUNREACH): the scheduler is told to stop.
            for _ in range(100):
                await h.output(started.rid, [6])
                with contextlib.suppress(asyncio.TimeoutError):
                    assert await h.to_scheduler(timeout=0.1) == AbortReq(started.rid)
                    return
            raise AssertionError("the request of a gone client was never aborted")

    asyncio.run(scenario())


def test_a_long_prompt_in_the_tokenizer_stalls_nobody(tiny_served_model):
    """While a 400,000-token prompt is tokenized (seconds), a running stream's replies keep going
    out, and requests that came after it from other clients (a small generate, a health check)
    are answered first. Its own client's abort, sent right after it, still finds it."""

    async def scenario() -> None:
        # A context this long lets a 2M-character prompt reach the tokenizer.
        async with tokenizer_manager(tiny_served_model, context_length=1_000_000) as h:
            streaming, long, small, probe = h.client(), h.client(), h.client(), h.client()
            await send(streaming, **generate("streams"))
            started = await h.to_scheduler()
            await send(long, type="generate", rid="long", text="word " * 400_000)
            await _until_in_the_tokenizer(h, "long")
            await send(long, type="abort", rid="long")
            await send(small, **generate("small", stream=False))
            await send(probe, type="health")
            arrived = {type(m): m for m in [await h.to_scheduler() for _ in range(2)]}
            assert arrived.keys() == {TokenizedGenerateReq, HealthReq}, (
                f"the small request and the health check waited for the long prompt: {arrived}"
            )
            await h.output(arrived[TokenizedGenerateReq].rid, [7], LENGTH)
            assert (await receive(small))["output_ids"] == [7]
            await h.backend.send(msgspec.msgpack.encode(HealthOut(arrived[HealthReq].query_id)))
            assert (await receive(probe))["type"] == "health"
            for i in range(5):
                await h.output(started.rid, [i])
                assert (await receive(streaming))["output_ids"] == [i]
            # All of that went out before the long prompt's tokens reached the scheduler.
            assert not await h.scheduler.poll(0)
            long_req = await h.to_scheduler(timeout=120)
            assert isinstance(long_req, TokenizedGenerateReq) and len(long_req.input_ids) > 10**5
            assert await h.to_scheduler() == AbortReq(long_req.rid)
            assert not await long.poll(100)  # no `not_found`: the abort found its request

    asyncio.run(scenario())


async def _until_in_the_tokenizer(h: Harness, rid: str) -> None:
    inflight = getattr(h.manager, "inflight", None)
    if inflight is None:  # the manager before issue 13 (tests/replay_issue13.py runs it)
        await asyncio.sleep(0.3)
        return
    while not any(rid in rids for rids in inflight.by_peer.values()):
        await asyncio.sleep(0.01)


def peak_rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def test_a_frame_over_the_size_limit_is_never_held(tiny_served_model):
    """ZMQ's MAXMSGSIZE drops the connection at the frame's header: 64 MiB never reach memory
    (before issue 13 the manager held the whole frame, then refused it: +115 MB)."""
    payload = b"\0" * (64 << 20)  # the sender's copy, counted before the measure

    def send_and_wait(address: str) -> None:
        with zmq.Context() as ctx:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(address)
            sock.send(payload, copy=False)
            sock.close(linger=30_000)  # the context ends once it is sent, or dropped

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, max_request_bytes=1 << 20) as h:
            Path("/proc/self/clear_refs").write_text("5")  # the peak so far is other tests'
            before = peak_rss_mb()
            await asyncio.to_thread(send_and_wait, h.address)
            other = h.client()
            await send(other, type="health")  # and the manager goes on
            assert isinstance(await h.to_scheduler(), HealthReq)
            await asyncio.sleep(0.2)
            grown = peak_rss_mb() - before
            assert grown < 16, f"peak RSS grew by {grown:.0f} MB: the frame was held"

    asyncio.run(scenario())


SMALL_BUFFERS = {"RCVHWM": 1, "RCVBUF": 1024}
LONG_TEXT = "t" * 2000  # 6,000 of them are over what the kernel's socket buffers hold


async def flood(h: Harness, cid: str, steps: int) -> None:
    for i in range(steps):
        await h.output(cid, [i % 100], LENGTH if i == steps - 1 else None, LONG_TEXT)


def test_a_slow_reader_gets_every_reply_in_the_end(tiny_served_model):
    """Far more replies than its queue (SNDHWM) and the socket buffers hold: they wait, and the
    client that reads at last gets all of them, the final one included."""
    steps = 6000

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client(**SMALL_BUFFERS)
            await send(client, **generate("slow", max_new_tokens=steps))
            started = await h.to_scheduler()
            await flood(h, started.rid, steps)
            await asyncio.sleep(0.5)  # all of it reached the manager: most of it must wait
            # (The manager before issue 13 had no outbox: tests/replay_issue13.py runs this there.)
            outbox = getattr(getattr(h.manager, "replies", None), "outbox", None)
            assert outbox is None or outbox.backlogs, "the test did not get past the queue"
            replies = []
            with contextlib.suppress(asyncio.TimeoutError):
                while len(replies) < steps:
                    replies.append(await receive(client, timeout=5))
            assert len(replies) == steps, f"{steps - len(replies)} replies lost, the final one too"
            assert [r["output_ids"] for r in replies] == [[i % 100] for i in range(steps)]
            assert replies[-1]["finished"]

    asyncio.run(scenario())


def test_a_reader_that_reads_nothing_is_tried_ever_less_often(tiny_served_model):
    """A client that stalls with replies waiting is not tried 100 times a second while the
    server idles: the retries back off (to MAX_FLUSH_INTERVAL_S); a new backlog brings the short
    interval back, and a client that reads again gets everything."""
    steps = 6000

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            outbox = h.manager.replies.outbox
            flushes = 0
            flush = outbox.flush

            def counted() -> list[bytes]:  # the real flush, counted
                nonlocal flushes
                flushes += 1
                return flush()

            outbox.flush = counted  # type: ignore[method-assign]
            client = h.client(**SMALL_BUFFERS)
            await send(client, **generate("stalled", max_new_tokens=steps))
            started = await h.to_scheduler()
            await flood(h, started.rid, steps)
            await asyncio.sleep(0.5)
            assert outbox.backlogs, "the test did not get past the queue"
            flushes = 0
            await asyncio.sleep(2.0)
            assert flushes <= 12, flushes  # at 10 ms each: 200
            replies = []
            with contextlib.suppress(asyncio.TimeoutError):
                while len(replies) < steps:
                    replies.append(await receive(client, timeout=5))
            assert len(replies) == steps and replies[-1]["finished"]

    asyncio.run(scenario())


def test_a_reader_too_slow_for_the_backlog_bound_is_aborted(tiny_served_model):
    steps = 6000

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, max_reply_backlog_bytes=20_000) as h:
            client = h.client(**SMALL_BUFFERS)
            await send(client, **generate("slow", max_new_tokens=steps))
            started = await h.to_scheduler()
            await flood(h, started.rid, steps)
            assert await h.to_scheduler() == AbortReq(started.rid)  # its KV is freed at once
            replies = []
            while not replies or replies[-1]["type"] != "error":
                replies.append(await receive(client))
            assert replies[-1]["code"] == "overloaded" and replies[-1]["rid"] == "slow"
            assert all(r["type"] == "output" and not r["finished"] for r in replies[:-1])
            assert len(replies) < steps
            assert not h.manager.replies.outbox.backlogs and not h.manager.inflight.by_peer

    asyncio.run(scenario())


@pytest.mark.parametrize("final", ["output", "refusal", "unknown_abort"])
def test_a_final_reply_waiting_for_a_slow_reader_is_never_lost(tiny_served_model, final):
    """A request already answered, its final reply (its last output; the scheduler's refusal;
    the error for an abort of a rid not in flight) still waiting in the backlog when another
    request pushes the backlog over the bound: it still gets one final reply (an error). The
    errors were lost so before."""
    steps = 6000

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, max_reply_backlog_bytes=200_000) as h:
            client = h.client(**SMALL_BUFFERS)
            await send(client, **generate("flood", max_new_tokens=steps))
            flooding = await h.to_scheduler()
            if final != "unknown_abort":
                await send(client, **generate("owed", stream=False, max_new_tokens=1))
                owed = await h.to_scheduler()
            for i in range(steps):  # until a backlog forms: the owed final waits behind it
                await h.output(flooding.rid, [i % 100], None, LONG_TEXT)
                if i % 10 == 9:  # so the backlog holds well under the bound then
                    await asyncio.sleep(0.02)
                    if h.manager.replies.outbox.backlogs:
                        break
            assert h.manager.replies.outbox.backlogs, "the test did not get past the queue"
            if final == "output":
                await h.output(owed.rid, [1], LENGTH)
            elif final == "refusal":
                refusal = ReqError(owed.rid, "too_long", "no room")
                await h.backend.send(msgspec.msgpack.encode(refusal))
            else:
                await send(client, type="abort", rid="owed")
            await asyncio.sleep(0.05)
            # Answered, its final queued behind the backlog.
            assert all("owed" not in of_client for of_client in h.manager.inflight.by_peer.values())
            await flood(h, flooding.rid, steps)
            finals: dict[str, list[dict]] = {"flood": [], "owed": []}
            while not all(finals.values()):
                reply = await receive(client)
                if reply["type"] == "error" or reply["finished"]:
                    finals[reply["rid"]].append(reply)
            await asyncio.sleep(0.2)
            while await client.poll(0):  # nothing more than one final each
                reply = await receive(client)
                assert reply["type"] != "error" and not reply["finished"], reply
            assert [r["code"] for r in finals["flood"]] == ["overloaded"]
            assert len(finals["owed"]) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "frames",
    [
        [b"part", b"\x81\xa4type\xa6health"],
        [b"", b"delimiter", b"\x81\xa4type\xa6health"],
    ],
)
def test_multipart_requests_are_refused_without_echoing_them(tiny_served_model, frames):
    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client = h.client()
            await client.send_multipart(frames)
            reply = await asyncio.wait_for(client.recv_multipart(), 10)
            # Only the routing id was kept as the envelope, and a REQ socket's empty delimiter.
            assert reply[:-1] == ([b""] if frames[0] == b"" else [])
            error = msgspec.msgpack.decode(reply[-1])
            assert error["type"] == "error" and "one frame" in error["message"]

    asyncio.run(scenario())


@pytest.mark.parametrize("field", ["text", "rid", "type"])
def test_a_string_that_is_not_utf8_is_that_clients_error(tiny_served_model, field):
    """msgpack strs must be UTF-8; msgspec raises UnicodeDecodeError (a ValueError, not its own
    DecodeError) for one that is not, which once ended the tokenizer manager, and the server."""
    bad = b"\xa3\xed\xa0\x80"  # a str of 3 bytes: a lone surrogate's UTF-8, not valid
    fields = {"type": b"\xa8generate", "rid": b"\xa1r", "text": b"\xa2hi"}
    fields[field] = bad
    frame = b"\x83" + b"".join(msgspec.msgpack.encode(k) + v for k, v in fields.items())

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            client, other = h.client(), h.client()
            await client.send(frame)
            reply = await receive(client)
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            await send(other, type="health")  # everyone else is still served
            assert isinstance(await h.to_scheduler(), HealthReq)

    asyncio.run(scenario())


def test_a_bug_on_a_requests_way_ends_it_and_names_its_rid(tiny_served_model):
    """A bug while a request goes to the scheduler (here its second completion's send fails)
    costs that request one `internal` error with its rid. What of it reached the scheduler is
    aborted, and the rid is free again: before, the error had no rid, the first completion ran
    on unseen and the rid stayed "already in flight" for good."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model) as h:
            link = h.manager.link
            real_send, sends = link.send, 0

            async def second_send_fails(message: object) -> None:
                nonlocal sends
                sends += 1
                if sends == 2:
                    raise RuntimeError("boom")
                await real_send(message)

            link.send = second_send_fails
            client = h.client()
            await send(client, **generate("x", n=2))
            first = await h.to_scheduler()
            assert isinstance(first, TokenizedGenerateReq)
            error = await receive(client)
            assert error["type"] == "error" and error["code"] == "internal", error
            assert error["rid"] == "x" and "boom" in error["message"]
            # Both are aborted: which sends got through is not known (an abort of an id the
            # scheduler never had costs it a lookup).
            aborts = [await h.to_scheduler() for _ in range(2)]
            assert AbortReq(first.rid) in aborts

            link.send = real_send
            await send(client, **generate("x"))  # the rid may be used again
            assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)

    asyncio.run(scenario())


def test_past_the_total_backlog_bound_the_largest_backlog_is_dropped(tiny_served_model):
    """Two slow readers, each far under its own bound (64 MiB) but together over the total one:
    the one with the most replies waiting has its request aborted (`overloaded`), though the
    other's reply is the one that passes the bound; the other still gets every reply."""

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, max_total_reply_backlog_bytes=400_000) as h:
            meter, backlog_bytes = h.manager.replies.backlog_meter, h.manager.replies.backlog_bytes
            big = h.client(ROUTING_ID=b"big", **SMALL_BUFFERS)
            small = h.client(ROUTING_ID=b"small", **SMALL_BUFFERS)
            await send(big, **generate("big", max_new_tokens=10**5))
            big_cid = (await h.to_scheduler()).rid
            await send(small, **generate("small", max_new_tokens=10**5))
            small_cid = (await h.to_scheduler()).rid
            while meter.nbytes < 250_000:  # once the sockets' buffers are full, a backlog forms
                for _ in range(10 if meter.nbytes else 100):
                    await h.output(big_cid, [0], None, LONG_TEXT)
                await asyncio.sleep(0.02)
            assert not await h.scheduler.poll(0)  # under the total bound still
            sent = 0
            while not await h.scheduler.poll(20):  # until small's replies pass the total
                for _ in range(10 if backlog_bytes(b"small") else 100):
                    await h.output(small_cid, [sent % 100], None, LONG_TEXT)
                    sent += 1
                assert sent < 20_000, "the test did not get past the queue"
            assert await h.to_scheduler() == AbortReq(big_cid)
            await h.output(small_cid, [1], LENGTH)
            replies = [await receive(small) for _ in range(sent + 1)]
            assert [r["output_ids"] for r in replies[:-1]] == [[i % 100] for i in range(sent)]
            assert replies[-1]["finished"] and not await small.poll(100)
            reply = await receive(big)
            while reply["type"] == "output":
                assert not reply["finished"]
                reply = await receive(big)
            assert (reply["code"], reply["rid"]) == ("overloaded", "big")
            assert "--max-total-reply-backlog-bytes" in reply["message"]
            assert meter.nbytes == 0 and not h.manager.inflight.by_peer

    asyncio.run(scenario())


def test_an_http_backlog_counts_its_replies_logprobs():
    """A streamed token with 256 top logprobs is ~30 KB held: the bound on an HTTP client's
    unread replies counted ~140 bytes for it, and a final with a prompt's 2^20 pairs as 128."""
    from radixserve.protocol.wire import MetaInfo, OutputReply
    from radixserve.tokenizer_manager.backlog_meter import BacklogMeter
    from radixserve.tokenizer_manager.local_client import LOGPROB_PAIR_BYTES, LocalClient

    async def scenario() -> None:
        meter = BacklogMeter(1 << 30)
        client = LocalClient(0, max_backlog_bytes=1_000_000, meter=meter)
        top = [[(-1.0, t) for t in range(256)]]
        meta = MetaInfo(1, 1, 0, None, 0.0, [(-1.0, 7)], top)
        assert client.put(OutputReply("r", "x", [7], False, meta))
        assert (
            client.backlog_bytes >= 257 * LOGPROB_PAIR_BYTES
            and meter.nbytes == client.backlog_bytes
        )
        fits = [client.put(OutputReply("r", "x", [7], False, meta)) for _ in range(40)]
        assert not all(fits)  # 41 of them pass the bound of 1 MB
        for _ in range(41):
            await client.get()
        assert client.backlog_bytes == 0 and meter.nbytes == 0

    asyncio.run(scenario())


def test_a_model_without_tokenizer_files_is_refused_at_start(tiny_model, tiny_served_model):
    """For a Qwen2 checkpoint whose weights came without their tokenizer files, transformers
    builds an empty tokenizer: the server said it was ready, then refused every prompt as no
    tokens."""
    from radixserve.tokenizer_manager.tokenization import Tokenization

    with pytest.raises(ValueError, match="has no tokenizer"):
        Tokenization(str(tiny_model("qwen2")), 256, 512)
    Tokenization(str(tiny_served_model), 49152, 1024).close()  # with its files: it loads


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "::"])
def test_an_ipv6_host_serves_zmq_clients(tiny_served_model, host):
    """ZMQ takes IPv4 only unless told: `--host ::1` passed the start's checks, loaded the
    model, and then failed to bind ("No such device")."""
    from radixserve.protocol.transport import allow_ipv6, tcp_address

    async def scenario() -> None:
        async with tokenizer_manager(tiny_served_model, host=host) as h:
            sock = h.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            address = tcp_address("::1", h.manager.args.port)
            allow_ipv6(sock, address)
            sock.connect(address)
            await send(sock, type="health")
            assert isinstance(await h.to_scheduler(), HealthReq)

    asyncio.run(scenario())
