"""The scheduler processes: TP rank 0 owns the scheduler and runs the event loop over ZMQ; the
other TP ranks (`run_tp_follower`) run the batches rank 0 broadcasts, in lockstep."""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgspec
import torch
import zmq

from radixserve.model_worker.tp_worker import TpModelWorker, follow_rank0
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    keep_freed_memory,
    release_freed_memory,
    report_ready,
    take_torch_threads,
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
    ReplicaLoad,
    SchedulerInput,
    SchedulerReady,
    ServerInfoOut,
    ServerInfoReq,
    StopReq,
    TokenizedGenerateReq,
)
from radixserve.protocol.wire import FinishReason
from radixserve.scheduler.rank_setup import build_model_runner, build_scheduler
from radixserve.server_args import RankPlacement, ServerArgs

# While grammars compile and nothing runs, look for them this often (the compile threads cannot
# wake the loop's ZMQ poll).
GRAMMAR_POLL_MS = 5


class SchedulerProcess:
    """TP rank 0 of one replica. With --dp-size above 1 its requests come from the data-parallel
    controller, which also gathers every replica's answers to control queries."""

    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        ipc_dir: str,
        heartbeat: Heartbeat,
        placement: RankPlacement | None = None,
    ):
        placement = placement or RankPlacement()
        self.dp_rank = placement.dp_rank
        self.heartbeat = heartbeat
        self.worker = TpModelWorker(build_model_runner(args, model_path, placement))
        self.scheduler, self.model_info = build_scheduler(args, model_path, self.worker)
        ctx = zmq.Context()
        input_name = transport.scheduler_input(placement.dp_rank, args.dp_size)
        self.recv_from_tokenizer = transport.bind_pull(ctx, ipc_dir, input_name)
        self.send_to_detokenizer = transport.connect_push(ctx, ipc_dir, transport.DETOKENIZER_INPUT)
        self.send_to_tokenizer = transport.connect_push(
            ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.send_control = self.send_to_tokenizer
        self.reports_load = args.dp_size > 1  # to the controller's router
        if self.reports_load:
            self.send_control = transport.connect_push(ctx, ipc_dir, transport.DP_CONTROLLER_INPUT)
        self.codec = transport.Codec(SchedulerInput)
        self.last_load: tuple[int, int] = (0, 0)  # as last reported

    def event_loop(self) -> None:
        scheduler = self.scheduler
        ran = False
        while True:
            self.heartbeat.beat()
            # Sleep until a message comes when the last step ran nothing: then nothing can run
            # until something changes (idle, or waiting requests that do not fit yet).
            compiling = bool(scheduler.grammars_compiling)
            idle_wait_ms = GRAMMAR_POLL_MS if compiling else int(HEARTBEAT_INTERVAL_S * 1000)
            msgs = self.recv_requests(0 if ran else idle_wait_ms)
            for msg in msgs:
                self.process_input_request(msg)
            if ran or msgs or compiling:
                was_running, ran = ran, scheduler.step() is not None
                self.stream_output()
                if was_running and not ran:
                    release_freed_memory()
            if not ran:
                self.worker.keep_alive()  # the other TP ranks beat on rank 0's broadcasts
            if self.reports_load:
                self.report_load()

    def recv_requests(self, wait_ms: int) -> list[msgspec.Struct]:
        """Everything queued now; with `wait_ms` (idle), first sleep until something arrives or
        that long has passed (time to beat, or to look at the compiling grammars)."""
        if wait_ms:
            self.recv_from_tokenizer.poll(wait_ms)
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
                error = scheduler.add_request(msg)
                if error is not None:
                    self._reply(error)
            case AbortReq(rid=rid):
                scheduler.abort(rid)
            case StopReq(rid=rid, matched=matched):
                scheduler.abort(rid, FinishReason("stop", matched))
            case ServerInfoReq(query_id=qid):
                info = msgspec.structs.replace(scheduler.server_info(), dp_rank=self.dp_rank)
                self._answer(ServerInfoOut(qid, info))
            case FlushCacheReq(query_id=qid):
                ok = scheduler.flush_cache()
                message = "" if ok else "requests are running; retry when idle"
                self._answer(FlushCacheOut(qid, ok, message))
            case HealthReq(query_id=qid):
                self._answer(HealthOut(qid))
            case ModelInfoReq(query_id=qid):
                self._answer(ModelInfoOut(qid, self.model_info))

    def report_load(self) -> None:
        """This replica's load to the controller, when it changed: at most once a step."""
        scheduler = self.scheduler
        load = (scheduler.stats.num_requests, len(scheduler.waiting) + len(scheduler.running))
        if load != self.last_load:
            self.last_load = load
            self._answer(ReplicaLoad(self.dp_rank, *load))

    def stream_output(self) -> None:
        for error in self.scheduler.errors:
            self._reply(error)
        self.scheduler.errors = []
        outbox = self.scheduler.outbox
        if outbox:
            self.send_to_detokenizer.send(self.codec.encode(BatchTokenOut(outbox)))
            self.scheduler.outbox = []

    def announce_ready(self) -> None:
        """Tell the tokenizer manager this replica serves: until every replica (and the
        detokenizer) has, it refuses generates and control queries with `not_ready` rather than
        hold them."""
        self._reply(SchedulerReady(self.dp_rank, self.scheduler.config.max_total_tokens))

    def _reply(self, msg: msgspec.Struct) -> None:
        self.send_to_tokenizer.send(self.codec.encode(msg))

    def _answer(self, msg: msgspec.Struct) -> None:
        """A control query's answer: to the tokenizer manager, or the DP controller."""
        self.send_control.send(self.codec.encode(msg))


def run_scheduler_process(
    args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
    placement: RankPlacement,
) -> None:
    configure_process(placement.process_name, args)
    take_torch_threads(args.threads_per_model_process)
    keep_freed_memory()
    proc = SchedulerProcess(args, model_path, ipc_dir, heartbeat, placement)
    report_ready(ready_writer, placement.process_name)
    proc.announce_ready()
    proc.event_loop()


def run_tp_follower(
    args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
    placement: RankPlacement,
) -> None:
    """TP rank 1 and up: no sockets, no scheduler; rank 0's batches, run as they come."""
    name = placement.process_name
    configure_process(name, args)
    take_torch_threads(args.threads_per_model_process)
    keep_freed_memory()
    runner = build_model_runner(args, model_path, placement)
    report_ready(ready_writer, name)
    with torch.inference_mode():
        while True:
            heartbeat.beat()
            follow_rank0(runner)
