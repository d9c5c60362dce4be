"""The data-parallel controller (--dp-size above 1): between the tokenizer manager and the
replicas' schedulers, as SGLang's DataParallelController.

It takes the scheduler input socket the tokenizer manager and detokenizer already push to, and
forwards: a new request to the replica its router picks (dp_router.py), from each replica's load;
an abort or stop to every replica (each ignores rids it does not hold, so the controller keeps no
table of who holds what); a control query to every replica, whose answers it gathers into one.
Outputs and admission errors go from the replicas straight to the detokenizer and the tokenizer
manager.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import msgspec
import zmq

from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    report_ready,
)
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    DpControllerInput,
    FlushCacheOut,
    HealthOut,
    ModelInfoOut,
    ReplicaLoad,
    SchedulerInput,
    ServerInfoOut,
    TokenizedGenerateReq,
)
from radixserve.protocol.wire import ServerInfoReply
from radixserve.scheduler.dp_router import ReplicaLoads, make_router
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.dp_controller")

ControlAnswer = ServerInfoOut | FlushCacheOut | HealthOut | ModelInfoOut


class DataParallelController:
    def __init__(self, args: ServerArgs, ipc_dir: str):
        self.router = make_router(args)
        self.loads = ReplicaLoads(args.dp_size)
        ctx = zmq.Context()
        self.recv_requests = transport.bind_pull(ctx, ipc_dir, transport.SCHEDULER_INPUT)
        self.recv_answers = transport.bind_pull(ctx, ipc_dir, transport.DP_CONTROLLER_INPUT)
        self.replicas = [
            transport.connect_push(ctx, ipc_dir, transport.scheduler_input(i, args.dp_size))
            for i in range(args.dp_size)
        ]
        self.send_to_tokenizer = transport.connect_push(
            ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT
        )
        self.request_codec = transport.Codec(SchedulerInput)
        self.answer_codec = transport.Codec(DpControllerInput)
        self.answers: dict[int, list[ControlAnswer]] = {}  # by query id, until all replicas answer
        self.poller = zmq.Poller()
        self.poller.register(self.recv_requests, zmq.POLLIN)
        self.poller.register(self.recv_answers, zmq.POLLIN)

    def event_loop(self, heartbeat: Heartbeat) -> None:
        while True:
            heartbeat.beat()
            ready = dict(self.poller.poll(int(HEARTBEAT_INTERVAL_S * 1000)))
            if self.recv_requests in ready:
                data = self.recv_requests.recv()
                self.route(self.request_codec.decode(data), data)
            if self.recv_answers in ready:
                self.gather(self.answer_codec.decode(self.recv_answers.recv()))

    def route(self, msg: msgspec.Struct, data: bytes) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.replicas[self.router.pick(msg.input_ids, self.loads)].send(data)
            return
        query_id = getattr(msg, "query_id", None)
        if query_id is not None:
            self.answers[query_id] = []
        for replica in self.replicas:
            replica.send(data)

    def gather(self, answer: msgspec.Struct) -> None:
        if isinstance(answer, ReplicaLoad):
            self.loads.report(answer)
            return
        assert isinstance(answer, ControlAnswer)  # replicas send nothing else here
        answers = self.answers[answer.query_id]
        answers.append(answer)
        if len(answers) == len(self.replicas):
            del self.answers[answer.query_id]
            self.send_to_tokenizer.send(self.answer_codec.encode(combine(answers)))


def combine(answers: list[ControlAnswer]) -> ControlAnswer:
    """One answer from every replica's (which come in any order)."""
    first = answers[0]
    if isinstance(first, ServerInfoOut):
        infos = sorted(
            (a.info for a in answers if isinstance(a, ServerInfoOut)), key=lambda i: i.dp_rank
        )
        return ServerInfoOut(first.query_id, sum_server_info(infos))
    if isinstance(first, FlushCacheOut):
        failed = [a for a in answers if isinstance(a, FlushCacheOut) and not a.success]
        return failed[0] if failed else first
    return first  # health: every replica answered; model_info: they serve the same model


def sum_server_info(infos: list[ServerInfoReply]) -> ServerInfoReply:
    prompt_tokens = sum(i.prompt_tokens for i in infos)
    cached = sum(i.cache_hit_rate * i.prompt_tokens for i in infos)

    def total(field: str) -> int:
        return sum(getattr(i, field) for i in infos)

    return ServerInfoReply(
        running_requests=total("running_requests"),
        waiting_requests=total("waiting_requests"),
        kv_tokens_used=total("kv_tokens_used"),
        kv_tokens_total=total("kv_tokens_total"),
        cache_hit_rate=cached / max(prompt_tokens, 1),
        gen_throughput=sum(i.gen_throughput for i in infos),
        num_steps=total("num_steps"),
        num_mixed_steps=total("num_mixed_steps"),
        num_retractions=total("num_retractions"),
        num_evicted_tokens=total("num_evicted_tokens"),
        num_prefill_tokens=total("num_prefill_tokens"),
        max_running_requests=total("max_running_requests"),
        prompt_tokens=prompt_tokens,
        replicas=infos,
        num_requests=total("num_requests"),
        spec_verifies=total("spec_verifies"),
        spec_draft_tokens=total("spec_draft_tokens"),
        spec_accepted_tokens=total("spec_accepted_tokens"),
    )


def run_dp_controller_process(
    args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
) -> None:
    configure_process("dp_controller", args)
    controller = DataParallelController(args, ipc_dir)
    report_ready(ready_writer, "dp_controller")
    logger.info("routing to %d replicas (%s)", args.dp_size, args.load_balance_method)
    controller.event_loop(heartbeat)
