"""The client endpoint: a ZMQ ROUTER speaking the wire format (docs/WIRE.md), on asyncio.

Two loops: `client_loop` decodes requests (request_decoder.py) and forwards them to the
scheduler, each generate through admission.py, in a task of its own so that a long prompt holds
up no one; `output_loop` turns what the detokenizer and scheduler send back into replies
(replies.py). The HTTP front (http_server/) comes in through `submit` as local clients.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from collections.abc import Hashable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.detokenizer.tokenizer_handoff import hand_over
from radixserve.model_worker.model_config import ModelConfig
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    BatchStrOut,
    DetokenizerReady,
    FlushCacheOut,
    FlushCacheReq,
    HealthOut,
    HealthReq,
    ModelInfoOut,
    ModelInfoReq,
    ReqError,
    ReqStrOut,
    SchedulerReady,
    ServerInfoOut,
    ServerInfoReq,
    TokenizerManagerInput,
)
from radixserve.protocol.wire import (
    AbortRequest,
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
from radixserve.tokenizer_manager.admission import SHUTTING_DOWN, Admission
from radixserve.tokenizer_manager.inflight import Envelope, InFlight
from radixserve.tokenizer_manager.intake import Intake
from radixserve.tokenizer_manager.local_client import LocalClient
from radixserve.tokenizer_manager.metrics import Metrics
from radixserve.tokenizer_manager.replies import Replies
from radixserve.tokenizer_manager.request_decoder import ClientError, RequestDecoder
from radixserve.tokenizer_manager.sampling_defaults import (
    apply_sampling_defaults,
    load_sampling_defaults,
)
from radixserve.tokenizer_manager.scheduler_link import SchedulerLink
from radixserve.tokenizer_manager.shutdown import FINAL_FLUSH_S, drain
from radixserve.tokenizer_manager.tokenization import Tokenization

logger = logging.getLogger("radixserve.tokenizer_manager")

# How long a control query (health, server_info, ...) waits for the scheduler before its client
# gets `overloaded`: a scheduler in a long step answers late, and a health check must not hang.
QUERY_TIMEOUT_S = 5.0
ROUTER_RCVHWM = 8


class TokenizerManager:
    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str):
        self.args = args
        model_config = ModelConfig.from_dir(model_path)
        # An upper bound on the prompt, to refuse text too long before tokenizing it; the
        # scheduler, which owns the context length, checks the token count.
        self.context_len = args.context_length or model_config.max_position_embeddings
        self.tokenization = Tokenization(model_path, model_config.vocab_size, self.context_len)
        hand_over(self.tokenization.loaded, ipc_dir)  # the detokenizer waits for it
        self.sampling_defaults = load_sampling_defaults(model_path, args.sampling_defaults)
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client fails
        self.router.setsockopt(zmq.MAXMSGSIZE, args.max_request_bytes)  # per frame (WIRE.md)
        # Frames libzmq holds per client before it stops reading that client's socket (TCP
        # pushes back): its default, 1,000 of up to --max-request-bytes each, is unbounded in
        # practice; what is read goes through the intake's caps.
        self.router.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
        address = transport.tcp_address(args.host, args.port)
        transport.allow_ipv6(self.router, address)
        self.router.bind(address)
        self.link = SchedulerLink(self.ctx, ipc_dir)
        self.recv_from_backend = transport.bind_pull(
            self.ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.decoder = RequestDecoder(args.api_key)
        self.codec = transport.Codec(TokenizerManagerInput)
        self.inflight = InFlight()
        self.replies = Replies(args, self.router, self.inflight, self.link)
        self.intake = Intake(args)
        self.admission = Admission(
            self.tokenization, self.inflight, self.link, self.replies, self.intake
        )
        # Each control query's client, and the timer that answers it if the scheduler does not.
        self.pending_queries: dict[int, tuple[Envelope, asyncio.TimerHandle]] = {}
        self._timeouts: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self.query_ids = itertools.count()
        self.metrics = Metrics()
        # Until every replica and the detokenizer are, requests get `not_ready`.
        self.replicas_ready: set[int] = set()
        self.detokenizer_ready = False
        self.model_ready = asyncio.Event()  # set once all are: then launch.py may say "ready"
        # The smallest replica's KV pool: what a request may hold at most (known once ready).
        self.kv_tokens = sys.maxsize
        self.query_timeout_s = QUERY_TIMEOUT_S

    @property
    def ready(self) -> bool:
        return self.detokenizer_ready and len(self.replicas_ready) == self.args.dp_size

    def check_ready(self, rid: str | None = None) -> None:
        if not self.ready:
            raise ClientError("not_ready", _NOT_READY, rid)

    # ---- client -> server ----------------------------------------------------------------------

    async def client_loop(self) -> None:
        while True:
            # A ready socket's recv does not yield: without this, a flood of frames would keep
            # the loop from everything else (tokenized requests, replies, HTTP health checks).
            await asyncio.sleep(0)
            frames = await self.router.recv_multipart()
            # A DEALER's request is [id, payload], a REQ's [id, b"", payload]: anything else
            # is not ours, and must not be echoed back at the size it came in.
            envelope = frames[:-1]
            if len(envelope) > 2 or envelope[1:] not in ([], [b""]):
                envelope = frames[:2] if frames[1] == b"" else frames[:1]
                error = ClientError("invalid_request", _ONE_FRAME)
                await self.replies.reply_error(envelope, error)
                continue
            try:
                req = self.decoder.decode(frames[-1])
                req = apply_sampling_defaults(req, frames[-1], self.sampling_defaults)
            except ClientError as e:
                await self.replies.reply_error(envelope, e)
                continue
            except Exception:  # a bug a frame found: that client's error, not everyone's end
                logger.exception("a request could not be read")
                await self.replies.reply_error(envelope, self.decoder.unreadable(frames[-1]))
                continue
            await self.submit(envelope, req)

    async def submit(self, envelope: Envelope, req: Any, arrived: float | None = None) -> None:
        """A decoded, authorized request, from either front door: its answers, or one error,
        go to `envelope`. A generate is only registered by the time this returns; `arrived`: when
        it came whole (time.monotonic()), where that was before now."""
        work = self.handle_request(envelope, req, arrived)
        await self.replies.answer_errors(envelope, work, getattr(req, "rid", None))

    async def handle_request(
        self, envelope: Envelope, req: Any, arrived: float | None = None
    ) -> None:
        if not isinstance(req, AbortRequest):
            self.check_ready(getattr(req, "rid", None))
        match req:
            case GenerateRequest():
                self.admission.admit(envelope, req, arrived)
            case AbortRequest(rid=rid):
                request = self.inflight.find(envelope[0], rid)
                if request is None:
                    raise ClientError("not_found", f"no request {rid!r} is in flight", rid)
                if request.aborted:
                    return  # its aborts went already: a repeat would only cost the scheduler
                request.aborted = True  # in the tokenizer still: aborted as it is sent
                await self.link.abort(self.inflight.live_ids(request))
            case ModelInfoRequest():
                await self.forward_query(envelope, ModelInfoReq)
            case HealthRequest():
                if not self.admission.accepting:  # draining: healthy no more, for new work
                    raise ClientError("overloaded", SHUTTING_DOWN)
                await self.forward_query(envelope, HealthReq)
            case ServerInfoRequest():
                await self.forward_query(envelope, ServerInfoReq)
            case FlushCacheRequest():
                await self.forward_query(envelope, FlushCacheReq)

    async def forward_query(self, envelope: Envelope, query_type: type) -> None:
        """Ask the scheduler; its answer goes to `envelope`, or `overloaded` if it has none
        within QUERY_TIMEOUT_S."""
        qid = next(self.query_ids)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.query_timeout_s, self._query_timed_out, qid)
        self.pending_queries[qid] = (envelope, timer)
        await self.link.send(query_type(qid))

    def _query_timed_out(self, qid: int) -> None:
        envelope, _ = self.pending_queries.pop(qid)
        message = f"the scheduler did not answer within {self.query_timeout_s:g}s (a long step)"
        task = asyncio.create_task(
            self.replies.reply_error(envelope, ClientError("overloaded", message))
        )
        self._timeouts.add(task)
        task.add_done_callback(self._timeouts.discard)

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
                case SchedulerReady(dp_rank=dp_rank, max_total_tokens=pool):
                    self.replicas_ready.add(dp_rank)
                    self.kv_tokens = min(self.kv_tokens, pool)
                    self._note_readiness()
                case DetokenizerReady():
                    self.detokenizer_ready = True
                    self._note_readiness()

    def _note_readiness(self) -> None:
        if self.ready and not self.model_ready.is_set():
            logger.info("The model is ready: taking requests")
            self.model_ready.set()

    async def handle_output(self, out: ReqStrOut) -> None:
        completion = self.inflight.completions.get(out.rid)
        if completion is None:
            return
        request = completion.request
        finished = out.finished_reason is not None
        if out.new_token_ids and request.counted:
            now = time.monotonic()
            self.metrics.on_tokens(request, completion.last_tokens_at, out, now)
            completion.last_tokens_at = now
        if finished:
            self.inflight.end(out.rid)
            if request.counted:
                self.metrics.on_finished(request, out)
            if self.args.log_requests and request.counted:
                request_log.finished(request, completion.index, out)
        if request.answered:  # an error ended it, or its client is gone
            return
        reply = completion.reply(out)
        if reply is not None:
            await self.replies.reply(request.envelope, reply, request)
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
        await self.link.abort(self.inflight.live_ids(request))
        error = ClientError(code, message, request.rid)
        await self.replies.reply_error(request.envelope, error, request)

    async def answer_query(self, qid: int, reply: msgspec.Struct) -> None:
        pending = self.pending_queries.pop(qid, None)
        if pending is not None:  # else it timed out: its client had `overloaded`
            envelope, timer = pending
            timer.cancel()
            await self.replies.reply(envelope, reply)

    # ---- in-process clients (the HTTP front) ---------------------------------------------------

    def open_local_client(self, owner: Hashable = None) -> LocalClient:
        return self.replies.open_local_client(owner)

    async def close_local_client(self, client: LocalClient) -> None:
        await self.replies.close_local_client(client)

    # ---- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """SIGTERM: refuse new requests, give those in flight --shutdown-timeout seconds to
        finish, abort the rest, and deliver every last reply before the process exits."""
        self.admission.accepting = False
        logger.info("Shutting down. %d requests in flight.", len(self.inflight.completions))
        await drain(self.inflight, self.link, self.replies, self.args.shutdown_timeout)

    def close(self) -> None:
        self.tokenization.close()
        # What ZMQ still queues for the clients gets its last chance to leave.
        self.ctx.destroy(linger=int(FINAL_FLUSH_S * 1000))


_NOT_READY = "the model is still loading; retry shortly"
_ONE_FRAME = "a request is one frame (after a REQ socket's empty delimiter)"
