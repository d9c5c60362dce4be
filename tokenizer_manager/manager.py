"""The client endpoint: a ZMQ ROUTER speaking the wire format (docs: WIRE.md), on asyncio.

Two loops: `client_loop` validates and tokenizes requests and forwards them to the scheduler;
`output_loop` turns what the detokenizer and scheduler send back into replies. Each reply goes to
the ROUTER envelope of the client that asked, and only to it.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

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
    Logprob,
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
    MAX_RID_CHARS,
    AbortRequest,
    ClientRequest,
    ErrorReply,
    FlushCacheReply,
    FlushCacheRequest,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    MetaInfo,
    ModelInfoRequest,
    OutputReply,
    ServerInfoRequest,
)
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.sampling_defaults import (
    apply_sampling_defaults,
    load_sampling_defaults,
)
from radixserve.tokenizer_manager.tokenization import Tokenization

logger = logging.getLogger("radixserve.tokenizer_manager")

Envelope = list[bytes]


@dataclass(slots=True)
class ReqState:
    """One completion in flight. A request with n > 1 has n of them, each its own scheduler
    request (rid "client-rid/index"), all answering under the client's rid."""

    envelope: Envelope
    stream: bool
    client_rid: str
    index: int | None  # which of the n completions; None when n == 1
    created: float = field(default_factory=time.monotonic)
    # Non-streaming: the pieces until finished.
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[Logprob] = field(default_factory=list)
    top_logprobs: list[list[Logprob]] = field(default_factory=list)


class TokenizerManager:
    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str):
        self.args = args
        self.tokenization = Tokenization(model_path, ModelConfig.from_dir(model_path).vocab_size)
        self.sampling_defaults = load_sampling_defaults(model_path, args.sampling_defaults)
        ctx = zmq.asyncio.Context()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://{args.host}:{args.port}")
        self.send_to_scheduler = transport.connect_push(ctx, ipc_dir, transport.SCHEDULER_INPUT)
        self.recv_from_backend = transport.bind_pull(
            ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.client_decoder = msgspec.msgpack.Decoder(ClientRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.codec = transport.Codec(TokenizerManagerInput)
        self.rid_states: dict[str, ReqState] = {}  # by scheduler rid
        self.completions: dict[str, list[str]] = {}  # client rid -> its scheduler rids in flight
        self.pending_queries: dict[int, Envelope] = {}
        self.query_ids = itertools.count()

    # ---- client -> server ----------------------------------------------------------------------

    async def client_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            envelope, payload = frames[:-1], frames[-1]
            try:
                await self.handle_request(envelope, self.decode_request(payload))
            except _ClientError as e:
                await self.reply(envelope, ErrorReply(e.code, e.message, rid=e.rid))
            except Exception as e:  # a bug must cost this client its request, not the server
                logger.exception("request failed")
                await self.reply(envelope, ErrorReply("internal", f"{type(e).__name__}: {e}"))

    def decode_request(self, payload: bytes) -> msgspec.Struct:
        if len(payload) > self.args.max_request_bytes:
            raise _ClientError(
                "invalid_request",
                f"request of {len(payload)} bytes is over the limit of "
                f"{self.args.max_request_bytes} (--max-request-bytes)",
            )
        try:
            req = self.client_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise _ClientError("invalid_request", str(e), _rid_of(payload)) from None
        return apply_sampling_defaults(req, payload, self.sampling_defaults)

    async def handle_request(self, envelope: Envelope, req: msgspec.Struct) -> None:
        match req:
            case GenerateRequest():
                await self.handle_generate(envelope, req)
            case AbortRequest(rid=rid):
                if rid not in self.completions:
                    raise _ClientError("not_found", f"no request {rid!r} is in flight", rid)
                for sub_rid in self.completions[rid]:
                    await self.send_to_scheduler.send(self.codec.encode(AbortReq(sub_rid)))
            case ModelInfoRequest():
                await self.forward_query(envelope, ModelInfoReq)
            case HealthRequest():
                await self.forward_query(envelope, HealthReq)
            case ServerInfoRequest():
                await self.forward_query(envelope, ServerInfoReq)
            case FlushCacheRequest():
                await self.forward_query(envelope, FlushCacheReq)

    async def handle_generate(self, envelope: Envelope, req: GenerateRequest) -> None:
        rid = req.rid or uuid.uuid4().hex
        n = req.sampling_params.n
        sub_rids = [rid] if n == 1 else [f"{rid}/{i}" for i in range(n)]
        if rid in self.completions or any(sub in self.rid_states for sub in sub_rids):
            raise _ClientError("invalid_request", f"rid {rid!r} is already in flight", rid)
        try:
            input_ids = self.tokenization.input_ids(req)
        except ValueError as e:
            raise _ClientError("invalid_request", str(e), rid) from None
        self.completions[rid] = list(sub_rids)
        for i, sub_rid in enumerate(sub_rids):
            params = req.sampling_params
            if n > 1:
                # Each completion samples on its own; seeded ones stay reproducible (seed + i).
                seed = None if params.seed is None else _wrap_int64(params.seed + i)
                params = msgspec.structs.replace(params, n=1, seed=seed)
            self.rid_states[sub_rid] = ReqState(envelope, req.stream, rid, i if n > 1 else None)
            msg = TokenizedGenerateReq(
                sub_rid,
                input_ids,
                params,
                req.stream,
                req.return_logprob,
                req.top_logprobs_num,
            )
            await self.send_to_scheduler.send(self.codec.encode(msg))

    async def forward_query(self, envelope: Envelope, query_type: type) -> None:
        qid = next(self.query_ids)
        self.pending_queries[qid] = envelope
        await self.send_to_scheduler.send(self.codec.encode(query_type(qid)))

    # ---- server -> client ----------------------------------------------------------------------

    async def output_loop(self) -> None:
        while True:
            msg = self.codec.decode(await self.recv_from_backend.recv())
            match msg:
                case BatchStrOut(outs=outs):
                    for out in outs:
                        await self.handle_output(out)
                case ReqError(rid=rid, code=code, message=message):
                    await self.handle_error(rid, code, message)
                case ServerInfoOut(query_id=qid, info=info):
                    await self.answer_query(qid, info)
                case FlushCacheOut(query_id=qid, success=ok, message=message):
                    await self.answer_query(qid, FlushCacheReply(ok, message))
                case HealthOut(query_id=qid):
                    await self.answer_query(qid, HealthReply())
                case ModelInfoOut(query_id=qid, info=info):
                    await self.answer_query(qid, info)

    async def handle_output(self, out: ReqStrOut) -> None:
        state = self.rid_states.get(out.rid)
        if state is None:
            return
        finished = out.finished_reason is not None
        if finished:
            self._forget(out.rid, state)
        if state.stream:
            text, ids = out.text, out.new_token_ids
            token_logprobs, top_logprobs = out.output_token_logprobs, out.output_top_logprobs
        else:
            state.text.append(out.text)
            state.output_ids += out.new_token_ids
            state.token_logprobs += out.output_token_logprobs or []
            state.top_logprobs += out.output_top_logprobs or []
            if not finished:
                return
            text, ids = "".join(state.text), state.output_ids
            token_logprobs = state.token_logprobs if out.output_token_logprobs is not None else None
            top_logprobs = state.top_logprobs if out.output_top_logprobs is not None else None
        meta = MetaInfo(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            finish_reason=out.finished_reason,
            e2e_latency=time.monotonic() - state.created,
            output_token_logprobs=token_logprobs,
            output_top_logprobs=top_logprobs,
        )
        reply = OutputReply(state.client_rid, text, ids, finished, meta, index=state.index)
        await self.reply(state.envelope, reply)

    async def handle_error(self, sub_rid: str, code: str, message: str) -> None:
        """The scheduler refused a request: one error for the client's whole request, and its
        other completions (n > 1) are aborted."""
        state = self.rid_states.get(sub_rid)
        if state is None:
            return
        siblings = list(self.completions[state.client_rid])
        for other in siblings:
            self._forget(other, self.rid_states[other])
            if other != sub_rid:
                await self.send_to_scheduler.send(self.codec.encode(AbortReq(other)))
        await self.reply(state.envelope, ErrorReply(code, message, rid=state.client_rid))

    def _forget(self, sub_rid: str, state: ReqState) -> None:
        del self.rid_states[sub_rid]
        remaining = self.completions[state.client_rid]
        remaining.remove(sub_rid)
        if not remaining:
            del self.completions[state.client_rid]

    async def answer_query(self, qid: int, reply: msgspec.Struct) -> None:
        envelope = self.pending_queries.pop(qid, None)
        if envelope is not None:
            await self.reply(envelope, reply)

    async def reply(self, envelope: Envelope, reply: msgspec.Struct) -> None:
        await self.router.send_multipart([*envelope, self.encoder.encode(reply)])


class _RidOnly(msgspec.Struct):
    rid: str | None = None


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


def _rid_of(payload: bytes) -> str | None:
    """The rid of a request that failed validation, so that its error can name it (WIRE.md: the
    rid goes back whenever it is known); None when even that cannot be read."""
    try:
        rid = _rid_decoder.decode(payload).rid
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return rid if rid is not None and len(rid) <= MAX_RID_CHARS else None


def _wrap_int64(value: int) -> int:
    """value mod 2**64 as a signed 64-bit integer: completion i of a seeded request draws from
    seed + i, which must stay a valid seed at the top of the range."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


class _ClientError(Exception):
    def __init__(self, code: str, message: str, rid: str | None = None):
        super().__init__(message)
        self.code, self.message, self.rid = code, message, rid
