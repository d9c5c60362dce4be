"""The scheduler process: owns the model worker (TP rank 0), runs the event loop over ZMQ."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import msgspec
import zmq

from radixserve.model_worker.model_config import ModelConfig, resolve_device, resolve_dtype
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    keep_freed_memory,
)
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    HealthOut,
    HealthReq,
    ModelInfoOut,
    ModelInfoReq,
    ProcessReady,
    ReqError,
    SchedulerInput,
    ServerInfoOut,
    ServerInfoReq,
    StopReq,
    TokenizedGenerateReq,
)
from radixserve.protocol.wire import FinishReason, ModelInfoReply
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.scheduler")


def build_scheduler(args: ServerArgs, model_path: str) -> tuple[Scheduler, ModelInfoReply]:
    """The scheduler with its model worker, and the model as it serves it (for model_info)."""
    device = resolve_device(args.device)
    checkpoint_dtype = ModelConfig.from_dir(model_path).dtype
    runner = ModelRunner(
        model_path,
        dtype=resolve_dtype(args.dtype, device, checkpoint_dtype=checkpoint_dtype),
        device=device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        tp=TPGroup(rank=0, size=1, group=None),
        seed=args.random_seed,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
    )
    model = runner.model_config
    context_len = args.context_length or model.max_position_embeddings
    max_running = min(
        args.max_running_requests or 256, runner.max_total_tokens, args.max_prefill_tokens
    )
    chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else context_len
    config = SchedulerConfig(
        max_total_tokens=runner.max_total_tokens,
        max_running_requests=max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=min(chunk, args.max_prefill_tokens),
        context_len=context_len,
        eos_token_ids=frozenset(model.eos_token_ids),
        log_interval=args.log_interval,
        check_invariants=args.check_invariants,
        enable_radix_cache=not args.disable_radix_cache,
        page_size=args.page_size,
        schedule_policy=args.schedule_policy,
        enable_overlap=not args.disable_overlap_schedule,
    )
    logger.info(
        "Model %s on %s, dtype %s. max_total_tokens=%d, max_running_requests=%d, "
        "context_len=%d, chunked_prefill_size=%d, overlap schedule %s",
        model.architecture,
        device,
        runner.dtype,
        config.max_total_tokens,
        max_running,
        context_len,
        config.chunked_prefill_size,
        "on" if config.enable_overlap else "off",
    )
    info = ModelInfoReply(
        model_path=model_path,
        architecture=model.architecture,
        context_length=context_len,
        vocab_size=model.vocab_size,
        dtype=str(runner.dtype).removeprefix("torch."),
    )
    return Scheduler(config, runner), info


class SchedulerProcess:
    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str, heartbeat: Heartbeat):
        self.max_queued_requests = args.max_queued_requests
        self.heartbeat = heartbeat
        self.scheduler, self.model_info = build_scheduler(args, model_path)
        ctx = zmq.Context()
        self.recv_from_tokenizer = transport.bind_pull(ctx, ipc_dir, transport.SCHEDULER_INPUT)
        self.send_to_detokenizer = transport.connect_push(ctx, ipc_dir, transport.DETOKENIZER_INPUT)
        self.send_to_tokenizer = transport.connect_push(
            ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.codec = transport.Codec(SchedulerInput)

    def event_loop(self) -> None:
        scheduler = self.scheduler
        ran = False
        while True:
            self.heartbeat.beat()
            # Sleep until a message comes when the last step ran nothing: then nothing can run
            # until something changes (idle, or waiting requests that do not fit yet).
            msgs = self.recv_requests(block=not ran)
            if not ran and not msgs:
                continue  # woken only to beat
            for msg in msgs:
                self.process_input_request(msg)
            ran = scheduler.step() is not None
            self.stream_output()

    def recv_requests(self, block: bool) -> list[msgspec.Struct]:
        """Everything queued now; when idle, first sleep until something arrives (or it is time
        to beat)."""
        if block:
            self.recv_from_tokenizer.poll(int(HEARTBEAT_INTERVAL_S * 1000))
        msgs: list[msgspec.Struct] = []
        while True:
            try:
                data = self.recv_from_tokenizer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            msgs.append(self.codec.decode(data))

    def process_input_request(self, msg: msgspec.Struct) -> None:
        scheduler = self.scheduler
        match msg:
            case TokenizedGenerateReq():
                if len(scheduler.waiting) >= self.max_queued_requests:
                    message = f"{len(scheduler.waiting)} requests wait (--max-queued-requests)"
                    self._reply(ReqError(msg.rid, "overloaded", message))
                    return
                error = scheduler.add_request(msg)
                if error is not None:
                    self._reply(error)
            case AbortReq(rid=rid):
                scheduler.abort(rid)
            case StopReq(rid=rid, matched=matched):
                scheduler.abort(rid, FinishReason("stop", matched))
            case ServerInfoReq(query_id=qid):
                self._reply(ServerInfoOut(qid, scheduler.server_info()))
            case FlushCacheReq(query_id=qid):
                ok = scheduler.flush_cache()
                message = "" if ok else "requests are running; retry when idle"
                self._reply(FlushCacheOut(qid, ok, message))
            case HealthReq(query_id=qid):
                self._reply(HealthOut(qid))
            case ModelInfoReq(query_id=qid):
                self._reply(ModelInfoOut(qid, self.model_info))

    def stream_output(self) -> None:
        outbox = self.scheduler.outbox
        if outbox:
            self.send_to_detokenizer.send(self.codec.encode(BatchTokenOut(outbox)))
            self.scheduler.outbox = []

    def _reply(self, msg: msgspec.Struct) -> None:
        self.send_to_tokenizer.send(self.codec.encode(msg))


def run_scheduler_process(
    args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
) -> None:
    configure_process("scheduler", args, torch_threads=args.num_threads)
    keep_freed_memory()
    proc = SchedulerProcess(args, model_path, ipc_dir, heartbeat)
    ready_writer.send_bytes(msgspec.msgpack.encode(ProcessReady("scheduler")))
    proc.event_loop()
