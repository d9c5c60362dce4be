"""`radixserve-client "prompt"` (or `python -m radixserve.client`): one completion, or one control
call, from the command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import msgspec

from radixserve.client.messages import ProtocolError, ServerError, tcp_address
from radixserve.client.sync_client import Client


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="radixserve-client", description="Talk to a radixserve server."
    )
    parser.add_argument("prompt", nargs="?", help="the prompt (plain text, or with --chat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for each reply"
    )
    sampling = parser.add_argument_group("sampling (server defaults when not given)")
    sampling.add_argument("--max-new-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--chat", action="store_true", help="send as a user message")
    info = parser.add_mutually_exclusive_group()
    for flag in ("--health", "--server-info", "--model-info"):
        info.add_argument(flag, action="store_true", help="print the reply as JSON")
    args = parser.parse_args(argv)
    asks_info = args.health or args.server_info or args.model_info
    if (args.prompt is None) != bool(asks_info):
        parser.error("give a prompt, or one of --health, --server-info, --model-info")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    address = tcp_address(args.host, args.port)
    try:
        with Client(address, timeout=args.timeout) as client:
            if args.prompt is None:
                print_json(control_reply(client, args))
            else:
                complete(client, args)
    except (ServerError, ProtocolError, TimeoutError, ConnectionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def control_reply(client: Client, args: argparse.Namespace) -> msgspec.Struct:
    if args.health:
        return client.health()
    if args.server_info:
        return client.server_info()
    return client.model_info()


def complete(client: Client, args: argparse.Namespace) -> None:
    params = sampling_params(args)
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"text": args.prompt}
    )
    if not args.stream:
        print(client.generate(**prompt, sampling_params=params).text)
        return
    # Closed before the client is, so that a Ctrl-C mid-stream still aborts the request.
    with contextlib.closing(client.stream(**prompt, sampling_params=params)) as chunks:
        for chunk in chunks:
            print(chunk.text, end="", flush=True)
    print()


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    params = {name: value for name, value in given.items() if value is not None}
    if args.ignore_eos:
        params["ignore_eos"] = True
    return params


def print_json(reply: msgspec.Struct) -> None:
    print(msgspec.json.format(msgspec.json.encode(reply), indent=2).decode())
