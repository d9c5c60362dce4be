"""The scheduler processes: TP rank 0 owns the scheduler and runs the event loop over ZMQ; the
other TP ranks (`run_tp_follower`) run the batches rank 0 broadcasts, in lockstep."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import msgspec
import torch
import zmq

from radixserve.model_worker.model_config import ModelConfig, resolve_device, resolve_dtype
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import init_tp_group
from radixserve.model_worker.tp_worker import TpModelWorker, follow_rank0
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    keep_freed_memory,
    release_freed_memory,
    report_ready,
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
from radixserve.protocol.wire import FinishReason, ModelInfoReply
from radixserve.scheduler.config import SchedulerConfig, SpecConfig
from radixserve.scheduler.grammar import GrammarBackend
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import RankPlacement, ServerArgs, speculative_num_draft_tokens

logger = logging.getLogger("radixserve.scheduler")

# While grammars compile and nothing runs, look for them this often (the compile threads cannot
# wake the loop's ZMQ poll).
GRAMMAR_POLL_MS = 5


def _rank_gpu(device: torch.device, args: ServerArgs, placement: RankPlacement) -> torch.device:
    """cuda:N as given, or one GPU per model process of this node in placement order (replicas
    share GPUs when there are fewer, with --mem-fraction-static lowered to fit). NCCL refuses
    two ranks of one TP group on one GPU ("Duplicate GPU detected") and CUDA an ordinal past
    its GPUs: refused here first, in words."""
    count = torch.cuda.device_count()
    ranks_here = args.tp_size // args.nnodes  # this node's ranks of each TP group
    if count == 0:
        raise ValueError(f"--device {args.device}, but no GPU is visible")
    if device.index is not None:
        if device.index >= count:
            raise ValueError(f"--device {args.device}, but GPUs 0 to {count - 1} are visible")
        if ranks_here > 1:
            raise ValueError(
                f"--device {args.device} puts all {ranks_here} TP ranks on one GPU; NCCL needs "
                "one each (--device cuda spreads them)"
            )
        return device
    if ranks_here > count:
        raise ValueError(
            f"--tp-size {args.tp_size} needs {ranks_here} GPUs on this node, one per TP rank; "
            f"{count} {'is' if count == 1 else 'are'} visible"
        )
    local = placement.dp_rank * ranks_here + placement.tp_rank % ranks_here
    return torch.device("cuda", local % count)


def build_model_runner(args: ServerArgs, model_path: str, placement: RankPlacement) -> ModelRunner:
    """This rank's shard of the model and its KV pool, once its TP group has met."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = _rank_gpu(device, args, placement)
        # Always, cuda:N too: NCCL and the overlap thread take the current device.
        torch.cuda.set_device(device)
    tp = init_tp_group(placement.tp_rank, args.tp_size, placement.dist_init_addr, device)
    checkpoint_dtype = ModelConfig.from_dir(model_path).dtype
    return ModelRunner(
        model_path,
        dtype=resolve_dtype(args.dtype, device, checkpoint_dtype=checkpoint_dtype),
        device=device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        tp=tp,
        seed=args.random_seed,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
        fused_layers=not args.disable_fused_layers,
        draft_model_path=args.speculative_draft_model_path,
    )


def speculative_config(args: ServerArgs) -> SpecConfig | None:
    if args.speculative_algorithm is None:
        return None
    return SpecConfig(
        algorithm=args.speculative_algorithm,
        num_draft_tokens=speculative_num_draft_tokens(args),
        ngram_min=args.speculative_ngram_min_match_window_size,
        ngram_max=args.speculative_ngram_max_match_window_size,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
    )


def overlap_schedule(args: ServerArgs, device: torch.device) -> bool:
    """Whether steps overlap: as the flags say, else only when a GPU runs the forward.

    Overlap hides the scheduler's CPU work behind a forward that runs elsewhere. On the CPU the
    forward's threads already take every core, and a forward launched from a second thread gets
    a second OpenMP team beside the main thread's: on the idle 2-core machine the same decode
    step took 39 ms there against 27 ms on the main thread, and overlap served 0.64x the
    throughput one request at a time, 0.86x at 64 (benchmarks/RESULTS.md).
    """
    if args.enable_overlap_schedule or args.disable_overlap_schedule:
        return args.enable_overlap_schedule
    return device.type != "cpu"


def build_scheduler(
    args: ServerArgs, model_path: str, worker: TpModelWorker
) -> tuple[Scheduler, ModelInfoReply]:
    """The scheduler over its model worker, and the model as it serves it (for model_info)."""
    runner = worker.runner
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
        enable_overlap=overlap_schedule(args, runner.device),
        speculative=speculative_config(args),
        max_queued_requests=args.max_queued_requests,
    )
    logger.info(
        "Model %s on %s, dtype %s. max_total_tokens=%d, max_running_requests=%d, "
        "context_len=%d, chunked_prefill_size=%d, overlap schedule %s, speculative %s",
        model.architecture,
        runner.device,
        runner.dtype,
        config.max_total_tokens,
        max_running,
        context_len,
        config.chunked_prefill_size,
        "on" if config.enable_overlap else "off",
        config.speculative,
    )
    info = ModelInfoReply(
        model_path=model_path,
        architecture=model.architecture,
        context_length=context_len,
        vocab_size=model.vocab_size,
        dtype=str(runner.dtype).removeprefix("torch."),
    )
    return Scheduler(config, worker, GrammarBackend(model_path, model.vocab_size)), info


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
        """Tell the tokenizer manager this replica serves: until every replica has, it refuses
        generates and control queries with `not_ready` rather than hold them."""
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
    configure_process(placement.process_name, args, torch_threads=args.threads_per_model_process)
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
    configure_process(name, args, torch_threads=args.threads_per_model_process)
    keep_freed_memory()
    runner = build_model_runner(args, model_path, placement)
    report_ready(ready_writer, name)
    with torch.inference_mode():
        while True:
            heartbeat.beat()
            follow_rank0(runner)
