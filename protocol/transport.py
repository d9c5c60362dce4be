"""ZMQ sockets between the server's processes: ipc:// PUSH/PULL in launch.py's private directory;
and the client endpoint's TCP address."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import zmq

# Internal messages are batches of token ids; anything this large is a bug, not traffic.
INTERNAL_MAX_MSG_BYTES = 256 * 1024 * 1024

# Socket names inside the IPC directory, one per receiving process.
SCHEDULER_INPUT = "scheduler_input"
DETOKENIZER_INPUT = "detokenizer_input"
TOKENIZER_MANAGER_INPUT = "tokenizer_manager_input"
DP_CONTROLLER_INPUT = "dp_controller_input"  # replicas' answers to control queries


def scheduler_input(dp_rank: int, dp_size: int) -> str:
    """A replica's input socket. With one replica the tokenizer manager feeds it directly; with
    several, the data-parallel controller takes SCHEDULER_INPUT and routes to these."""
    return SCHEDULER_INPUT if dp_size == 1 else f"{SCHEDULER_INPUT}_{dp_rank}"


def tcp_address(host: str, port: int) -> str:
    """The client endpoint's ZMQ address: an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def allow_ipv6(sock: zmq.Socket, address: str) -> None:
    """ZMQ's TCP sockets take IPv4 only unless told (an IPv6 address then fails: "No such
    device"); told, `::` serves both families."""
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def ipc_endpoint(ipc_dir: str, name: str) -> str:
    return "ipc://" + os.path.join(ipc_dir, name)


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.MAXMSGSIZE, INTERNAL_MAX_MSG_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def bind_pull(ctx: zmq.Context, ipc_dir: str, name: str) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PULL))
    sock.bind(ipc_endpoint(ipc_dir, name))
    return sock


def connect_push(ctx: zmq.Context, ipc_dir: str, name: str) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PUSH))
    sock.connect(ipc_endpoint(ipc_dir, name))
    return sock


class Codec:
    """msgpack encoder plus a decoder typed to what one socket may receive."""

    def __init__(self, receive_type: Any):
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(receive_type)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, data: bytes) -> Any:
        return self.decoder.decode(data)
