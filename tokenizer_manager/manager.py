"""The client endpoint: a ZMQ ROUTER speaking the wire format (docs/WIRE.md), on asyncio.

Two loops: `client_loop` decodes requests (request_decoder.py) and forwards them to the
scheduler, each generate tokenized in a task of its own so that a long prompt holds up no one;
`output_loop` turns what the detokenizer and scheduler send back into replies.
Each reply goes to the client that asked, and only to it; a client that is gone or reads too
slowly has its requests aborted, so their KV is freed at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.model_worker.model_config import ModelConfig
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    HealthOut,
    HealthReq,
    ModelInfoOut,
    ModelInfoReq,
    ReqError,
    ReqStrOut,
    ServerInfoOut,
    ServerInfoReq,
    TokenizedGenerateReq,
    TokenizerManagerInput,
)
from radixserve.protocol.wire import (
    INT64_MIN,
    AbortRequest,
    ErrorReply,
    FlushCacheReply,
    FlushCacheRequest,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    ModelInfoRequest,
    ServerInfoRequest,
)
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager import request_log
from radixserve.tokenizer_manager.backlog_meter import BacklogMeter
from radixserve.tokenizer_manager.inflight import Envelope, InFlight, InFlightRequest
from radixserve.tokenizer_manager.local_client import LocalClient
from radixserve.tokenizer_manager.metrics import Metrics
from radixserve.tokenizer_manager.outbox import Delivery, Outbox
from radixserve.tokenizer_manager.request_decoder import ClientError, RequestDecoder
from radixserve.tokenizer_manager.sampling_defaults import (
    apply_sampling_defaults,
    load_sampling_defaults,
)
from radixserve.tokenizer_manager.tokenization import PromptTooLong, Tokenization

logger = logging.getLogger("radixserve.tokenizer_manager")

FLUSH_INTERVAL_S = 0.01  # how often replies waiting for a slow client are tried again
ABORT_WAIT_S = 10.0  # at shutdown, how long the scheduler may take to end aborted requests
FINAL_FLUSH_S = 2.0  # at shutdown, how long the last replies may take to leave


class TokenizerManager:
    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str):
        self.args = args
        model_config = ModelConfig.from_dir(model_path)
        # An upper bound on the prompt, to refuse text too long before tokenizing it; the
        # scheduler, which owns the context length, checks the token count.
        self.context_len = args.context_length or model_config.max_position_embeddings
        self.tokenization = Tokenization(model_path, model_config.vocab_size, self.context_len)
        self.sampling_defaults = load_sampling_defaults(model_path, args.sampling_defaults)
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client fails
        self.router.setsockopt(zmq.MAXMSGSIZE, args.max_request_bytes)  # per frame (WIRE.md)
        self.router.bind(f"tcp://{args.host}:{args.port}")
        self.backlog_meter = BacklogMeter(args.max_total_reply_backlog_bytes)
        self.outbox = Outbox(self.router, args.max_reply_backlog_bytes, self.backlog_meter)
        self.send_to_scheduler = transport.connect_push(
            self.ctx, ipc_dir, transport.SCHEDULER_INPUT
        )
        self.recv_from_backend = transport.bind_pull(
            self.ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.decoder = RequestDecoder(args.api_key)
        self.encoder = msgspec.msgpack.Encoder()
        self.codec = transport.Codec(TokenizerManagerInput)
        self.inflight = InFlight()
        self.pending_queries: dict[int, Envelope] = {}
        self.query_ids = itertools.count()
        self.local_clients: dict[bytes, LocalClient] = {}
        self.local_ids = itertools.count()
        self.metrics = Metrics()
        self.accepting = True
        self.admissions: set[asyncio.Task[None]] = set()  # generates on their way in

    # ---- client -> server ----------------------------------------------------------------------

    async def client_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            # A DEALER's request is [id, payload], a REQ's [id, b"", payload]: anything else
            # is not ours, and must not be echoed back at the size it came in.
            envelope = frames[:-1]
            if len(envelope) > 2 or envelope[1:] not in ([], [b""]):
                envelope = frames[:2] if frames[1] == b"" else frames[:1]
                await self.reply_error(envelope, ClientError("invalid_request", _ONE_FRAME))
                continue
            try:
                req = self.decoder.decode(frames[-1])
                req = apply_sampling_defaults(req, frames[-1], self.sampling_defaults)
            except ClientError as e:
                await self.reply_error(envelope, e)
                continue
            await self.submit(envelope, req)

    async def submit(self, envelope: Envelope, req: Any) -> None:
        """A decoded, authorized request, from either front door: its answers, or one error,
        go to `envelope`. A generate is only registered here; its admission goes on in a task
        of its own (`admit`)."""
        await self.answer_errors(envelope, self.handle_request(envelope, req))

    async def answer_errors(self, envelope: Envelope, work: Awaitable[None]) -> None:
        try:
            await work
        except ClientError as e:
            await self.reply_error(envelope, e)
        except Exception as e:  # a bug must cost this client its request, not the server
            logger.exception("request failed")
            error = ClientError("internal", f"{type(e).__name__}: {e}")
            await self.reply_error(envelope, error)

    async def handle_request(self, envelope: Envelope, req: Any) -> None:
        match req:
            case GenerateRequest():
                self.admit(envelope, req)
            case AbortRequest(rid=rid):
                request = self.inflight.find(envelope[0], rid)
                if request is None:
                    raise ClientError("not_found", f"no request {rid!r} is in flight", rid)
                request.aborted = True  # in the tokenizer still: aborted as it is sent
                await self.abort(self.inflight.live_ids(request))
            case ModelInfoRequest():
                await self.forward_query(envelope, ModelInfoReq)
            case HealthRequest():
                await self.forward_query(envelope, HealthReq)
            case ServerInfoRequest():
                await self.forward_query(envelope, ServerInfoReq)
            case FlushCacheRequest():
                await self.forward_query(envelope, FlushCacheReq)

    def admit(self, envelope: Envelope, req: GenerateRequest) -> None:
        """Register the request at once, so that its client's next messages (an abort) find
        it, then tokenize it and send it to the scheduler in a task: while a long prompt is in
        the tokenizer, the manager goes on taking everyone's requests."""
        rid = req.rid or uuid.uuid4().hex
        if not self.accepting:
            raise ClientError("overloaded", "the server is shutting down", rid)
        request = self.inflight.open(envelope, rid, req.stream, req.sampling_params.n)
        if request is None:
            raise ClientError("invalid_request", f"rid {rid!r} is already in flight", rid)
        task = asyncio.create_task(self.answer_errors(envelope, self._admit(request, req)))
        self.admissions.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self.admissions.discard)

    async def _admit(self, request: InFlightRequest, req: GenerateRequest) -> None:
        try:
            input_ids = await self.tokenization.input_ids_async(req)
        except Exception as e:
            self.inflight.answer(request)  # it never reached the scheduler: its rid is free
            if not isinstance(e, ValueError):
                raise
            code = "too_long" if isinstance(e, PromptTooLong) else "invalid_request"
            raise ClientError(code, str(e), request.rid) from None
        # Nothing awaits from here to the last send: an abort of this request comes before all
        # of it (request.aborted) or after all of it (its completions are live by then).
        sends = []
        base = req.sampling_params
        for cid, index in self.inflight.start(request):
            if request.answered:  # its client went away meanwhile: never started
                self.inflight.end(cid)
                continue
            params = base
            if index is not None:
                # Each completion samples on its own; seeded ones stay reproducible (seed + i).
                seed = None if base.seed is None else _wrap_int64(base.seed + index)
                params = msgspec.structs.replace(base, n=1, seed=seed)
            msg = TokenizedGenerateReq(
                cid, input_ids, params, req.stream, req.return_logprob, req.top_logprobs_num
            )
            sends.append(self.to_scheduler(msg))
        if request.aborted and not request.answered:
            sends += [self.to_scheduler(AbortReq(cid)) for cid in self.inflight.live_ids(request)]
        await asyncio.gather(*sends)

    def to_scheduler(self, msg: msgspec.Struct) -> Awaitable[Any]:
        """Send `msg` to the scheduler. pyzmq queues a send when it is called, so the order of
        the calls is the order the scheduler sees, whenever their results are awaited."""
        return self.send_to_scheduler.send(self.codec.encode(msg))

    async def forward_query(self, envelope: Envelope, query_type: type) -> None:
        qid = next(self.query_ids)
        self.pending_queries[qid] = envelope
        await self.to_scheduler(query_type(qid))

    async def abort(self, ids: list[str]) -> None:
        await asyncio.gather(*[self.to_scheduler(AbortReq(cid)) for cid in ids])

    # ---- server -> client ----------------------------------------------------------------------

    async def output_loop(self) -> None:
        while True:
            msg = self.codec.decode(await self.recv_from_backend.recv())
            match msg:
                case BatchStrOut(outs=outs):
                    for out in outs:
                        await self.handle_output(out)
                case ReqError(rid=cid, code=code, message=message):
                    await self.handle_refusal(cid, code, message)
                case ServerInfoOut(query_id=qid, info=info):
                    await self.answer_query(qid, info)
                case FlushCacheOut(query_id=qid, success=ok, message=message):
                    await self.answer_query(qid, FlushCacheReply(ok, message))
                case HealthOut(query_id=qid):
                    await self.answer_query(qid, HealthReply("ok"))
                case ModelInfoOut(query_id=qid, info=info):
                    await self.answer_query(qid, info)

    async def handle_output(self, out: ReqStrOut) -> None:
        completion = self.inflight.completions.get(out.rid)
        if completion is None:
            return
        request = completion.request
        finished = out.finished_reason is not None
        if out.new_token_ids:
            now = time.monotonic()
            self.metrics.on_tokens(request, completion.last_tokens_at, out, now)
            completion.last_tokens_at = now
        if finished:
            self.metrics.on_finished(request, out)
            self.inflight.end(out.rid)
            if self.args.log_requests:
                request_log.finished(request, completion.index, out)
        if request.answered:  # an error ended it, or its client is gone
            return
        reply = completion.reply(out)
        if reply is not None:
            await self.reply(request.envelope, reply, request)
        if finished and not request.answered:
            request.open -= 1
            if request.open == 0:
                self.inflight.answer(request)

    async def handle_refusal(self, cid: str, code: str, message: str) -> None:
        """The scheduler refused a completion: one error for the client's whole request, and its
        other completions (n > 1) are aborted."""
        completion = self.inflight.end(cid)
        if completion is None or completion.request.answered:
            return
        request = completion.request
        self.inflight.answer(request)
        await self.abort(self.inflight.live_ids(request))
        await self.reply_error(request.envelope, ClientError(code, message, request.rid))

    async def drop_client(self, peer: bytes, too_slow_for: str | None = None) -> None:
        """Abort every request of a client that is gone, or that reads too slowly (past the
        bound named by `too_slow_for`): then each of them gets one `overloaded` error in place
        of the replies it did not read."""
        if too_slow_for is not None:
            logger.warning(
                "A client reads too slowly: %d bytes of replies wait for it, past %s. "
                "Aborting its %d requests.",
                self.backlog_bytes(peer),
                too_slow_for,
                len(self.inflight.of_peer(peer)),
            )
        lost = self.outbox.drop(peer)
        requests = self.inflight.of_peer(peer)
        # A request already answered whose last replies were among those thrown away is owed an
        # error too: every request ends with exactly one final reply.
        owed = requests + [r for r in lost if isinstance(r, InFlightRequest) and r.answered]
        if too_slow_for is None and requests:
            logger.info("A client went away. Aborting its %d requests.", len(requests))
        for request in requests:  # all answered first: a concurrent drop finds none of them
            self.inflight.answer(request)
        for request in requests:
            await self.abort(self.inflight.live_ids(request))
        if too_slow_for is None:
            return
        message = f"replies to this client went unread past {too_slow_for}: request aborted"
        local = self.local_clients.get(peer)
        if local is not None:  # an HTTP request, which one error ends
            local.fail(ErrorReply("overloaded", message))
            return
        for request in owed:
            self._deliver(request.envelope, ErrorReply("overloaded", message, rid=request.rid))

    async def drop_largest_backlog(self) -> None:
        """Replies held for all clients together passed --max-total-reply-backlog-bytes: the
        client that has the most of them waiting is dropped."""
        peers = [*self.outbox.backlogs, *self.local_clients]
        largest = max(peers, key=self.backlog_bytes)
        await self.drop_client(largest, too_slow_for=_TOTAL_BOUND)

    def backlog_bytes(self, peer: bytes) -> int:
        local = self.local_clients.get(peer)
        if local is not None:
            return local.backlog_bytes
        backlog = self.outbox.backlogs.get(peer)
        return 0 if backlog is None else backlog.nbytes

    async def flush_loop(self) -> None:
        """Retry the replies that wait for room in a slow client's queue."""
        while True:
            await self.outbox.waiting.wait()
            for peer in self.outbox.flush():
                await self.drop_client(peer)
            await asyncio.sleep(FLUSH_INTERVAL_S)

    async def answer_query(self, qid: int, reply: msgspec.Struct) -> None:
        envelope = self.pending_queries.pop(qid, None)
        if envelope is not None:
            await self.reply(envelope, reply)

    async def reply_error(self, envelope: Envelope, error: ClientError) -> None:
        if self.args.log_requests:
            request_log.failed(error.rid, error.code, error.message)
        await self.reply(envelope, ErrorReply(error.code, error.message, rid=error.rid))

    async def reply(
        self, envelope: Envelope, reply: msgspec.Struct, request: InFlightRequest | None = None
    ) -> None:
        match self._deliver(envelope, reply, request):
            case Delivery.GONE:
                await self.drop_client(envelope[0])
            case Delivery.OVERFLOW:
                await self.drop_client(envelope[0], too_slow_for=_CLIENT_BOUND)
        if self.backlog_meter.over:
            await self.drop_largest_backlog()

    def _deliver(
        self, envelope: Envelope, reply: msgspec.Struct, request: InFlightRequest | None = None
    ) -> Delivery:
        local = self.local_clients.get(envelope[0])
        if local is not None:
            return Delivery.SENT if local.put(reply) else Delivery.OVERFLOW
        return self.outbox.send(envelope, self.encoder.encode(reply), request)

    # ---- in-process clients (the HTTP front) ---------------------------------------------------

    def open_local_client(self) -> LocalClient:
        client = LocalClient(
            next(self.local_ids), self.args.max_reply_backlog_bytes, self.backlog_meter
        )
        self.local_clients[client.peer] = client
        return client

    async def close_local_client(self, client: LocalClient) -> None:
        """The client is done or gone: what it still has in flight is aborted."""
        if self.local_clients.pop(client.peer, None) is not None:
            client.close()
            await self.drop_client(client.peer)

    # ---- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """SIGTERM: refuse new requests, give those in flight --shutdown-timeout seconds to
        finish, abort the rest, and deliver every last reply before the process exits."""
        self.accepting = False
        logger.info("Shutting down. %d requests in flight.", len(self.inflight.completions))
        await self._wait_for_no_completions(self.args.shutdown_timeout, abort=False)
        await self._wait_for_no_completions(ABORT_WAIT_S, abort=True)
        deadline = time.monotonic() + FINAL_FLUSH_S
        while self.outbox.backlogs and time.monotonic() < deadline:
            self.outbox.flush()
            await asyncio.sleep(FLUSH_INTERVAL_S)

    def close(self) -> None:
        self.tokenization.close()
        # What ZMQ still queues for the clients gets its last chance to leave.
        self.ctx.destroy(linger=int(FINAL_FLUSH_S * 1000))

    async def _wait_for_no_completions(self, timeout: float, abort: bool) -> None:
        aborted: set[str] = set()
        deadline = time.monotonic() + timeout
        # by_peer: a request whose prompt is still in the tokenizer has no completion yet.
        while (self.inflight.completions or self.inflight.by_peer) and time.monotonic() < deadline:
            if abort:  # those started meanwhile too: a prompt may have been in the tokenizer
                late = self.inflight.completions.keys() - aborted
                await self.abort(list(late))
                aborted |= late
            await asyncio.sleep(0.02)


_ONE_FRAME = "a request is one frame (after a REQ socket's empty delimiter)"
_CLIENT_BOUND = "--max-reply-backlog-bytes"
_TOTAL_BOUND = "--max-total-reply-backlog-bytes (all clients together; this one had the most)"


def _wrap_int64(value: int) -> int:
    """value mod 2**64 as a signed 64-bit integer: completion i of a seeded request draws from
    seed + i, which must stay a valid seed at the top of the range."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN
