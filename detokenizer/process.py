"""The detokenizer process: token ids from the scheduler in, text to the tokenizer manager out."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import zmq

from radixserve.detokenizer.incremental import IncrementalDetokenizer
from radixserve.detokenizer.tokenizer_handoff import take_over
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    report_ready,
)
from radixserve.protocol import transport
from radixserve.protocol.internal import BatchStrOut, BatchTokenOut, DetokenizerReady
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_detokenizer_process(
    server_args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
) -> None:
    configure_process("detokenizer", server_args)
    detokenizer = IncrementalDetokenizer(take_over(ipc_dir, model_path, heartbeat.beat))
    ctx = zmq.Context(io_threads=1)
    recv_sock = transport.bind_pull(ctx, ipc_dir, transport.DETOKENIZER_INPUT)
    send_sock = transport.connect_push(ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT)
    to_scheduler = transport.connect_push(ctx, ipc_dir, transport.SCHEDULER_INPUT)
    codec = transport.Codec(BatchTokenOut)

    send_sock.send(codec.encode(DetokenizerReady()))
    report_ready(ready_writer, "detokenizer")
    ready_writer.close()
    logger.info("ready")
    while True:
        heartbeat.beat()
        # The process sleeps while nothing is generated, waking only to beat.
        if not recv_sock.poll(int(HEARTBEAT_INTERVAL_S * 1000)):
            continue
        batch: BatchTokenOut = codec.decode(recv_sock.recv())
        strs, stops = detokenizer.step(batch.outs)
        for stop in stops:
            to_scheduler.send(codec.encode(stop))
        send_sock.send(codec.encode(BatchStrOut(outs=strs)))
