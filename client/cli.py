"""`radixserve-client` (or `python -m radixserve.client`): a completion, a chat, or one control
call, from the command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.client.messages import DEFAULT_TIMEOUT, ProtocolError, ServerError
from radixserve.client.sync_client import Client
from radixserve.protocol.transport import tcp_address
from radixserve.protocol.wire import OutputReply

# Sampling flags: (sampling_params field, type, help). Left out, a field takes the server's
# default, which may come from the model (launch.py --sampling-defaults).
SAMPLING_FLAGS: list[tuple[str, type, str]] = [
    ("max_new_tokens", int, "most tokens to generate"),
    ("temperature", float, "0: greedy"),
    ("top_p", float, "nucleus sampling: the smallest set of tokens over this probability"),
    ("top_k", int, "sample among the k likeliest tokens (-1: all)"),
    ("min_p", float, "drop tokens below this fraction of the likeliest one's probability"),
    ("repetition_penalty", float, "above 1 discourages tokens already in prompt or output"),
    ("seed", int, "the same seed and request give the same tokens"),
    ("n", int, "completions of the prompt, printed one after the other"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="radixserve-client", description="Talk to a radixserve server."
    )
    parser.add_argument("prompt", nargs="?", help="the prompt (plain text, or with --chat)")
    parser.add_argument("--host", default="127.0.0.1", help="server host (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=30000, help="server port (default: %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the server's --api-key (default: $RADIXSERVE_API_KEY, which unlike a flag does not "
        "show in `ps`; else none)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds to wait for each reply (default: %(default)s)",
    )
    chat = parser.add_argument_group("chat (through the model's chat template)")
    chat.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    chat.add_argument("--system", help="a system message first (implies --chat)")
    chat.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="a conversation: each line of stdin is the next user message, answered with the "
        "whole conversation so far; ends at end of input (Ctrl-D)",
    )
    sampling = parser.add_argument_group("sampling (left out: the server's defaults)")
    for name, kind, help_text in SAMPLING_FLAGS:
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    sampling.add_argument(
        "--stop", action="append", help="end the output before this string (repeat for more)"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="go on past end of sequence")
    output = parser.add_argument_group("output")
    output.add_argument("--stream", action="store_true", help="print text as it is generated")
    output.add_argument(
        "--logprobs", action="store_true", help="print each output token's id and logprob"
    )
    output.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        metavar="N",
        help="and the N likeliest tokens at each step (implies --logprobs)",
    )
    info = parser.add_mutually_exclusive_group()
    for flag, what in (
        ("--health", "whether the server serves"),
        ("--server-info", "the server's load and counters"),
        ("--model-info", "the served model"),
    ):
        info.add_argument(flag, action="store_true", help=f"print {what}, as JSON")
    args = parser.parse_args(argv)
    asks_info = args.health or args.server_info or args.model_info
    if asks_info == (args.prompt is not None or args.interactive):
        parser.error(
            "give a prompt, --interactive, or one of --health, --server-info, --model-info"
        )
    if (args.n or 1) > 1 and (args.stream or args.interactive):
        parser.error("--n > 1 prints whole completions: not with --stream or --interactive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        address = tcp_address(args.host, args.port)
        with Client(address, timeout=args.timeout, api_key=args.api_key) as client:
            if args.interactive:
                converse(client, args)
            elif args.prompt is not None:
                complete(client, args, prompt_request(args, args.prompt), args.stream)
            else:
                print_json(control_reply(client, args))
            sys.stdout.flush()  # here, where a reader gone is caught, not at the exit's flush
    except BrokenPipeError:  # the reader went away (`| head`): quietly, as other tools stop
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what stdout still holds goes nowhere at exit
        os.close(devnull)
        return 128 + signal.SIGPIPE
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


def system_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    return [] if args.system is None else [{"role": "system", "content": args.system}]


def prompt_request(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    if args.chat or args.system is not None:
        return {"messages": [*system_messages(args), {"role": "user", "content": prompt}]}
    return {"text": prompt}


def converse(client: Client, args: argparse.Namespace) -> None:
    """Multi-turn chat: every answer joins the conversation that the next turn sends."""
    messages = system_messages(args)
    for line in user_lines(args.prompt):
        messages.append({"role": "user", "content": line})
        answer = complete(client, args, {"messages": messages}, stream=True)
        messages.append({"role": "assistant", "content": answer})


def user_lines(first: str | None) -> Iterator[str]:
    """The prompt argument, then each non-empty line of stdin; a prompt mark only on a
    terminal, so that a pipe (a script, a test) gets the answers alone."""
    if first:
        yield first
    mark = "> " if sys.stdin.isatty() else ""
    while True:
        try:
            line = input(mark).strip()
        except EOFError:
            return
        if line:
            yield line


@dataclass
class Completion:
    text: list[str] = field(default_factory=list)
    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def add(self, chunk: OutputReply) -> None:
        self.text.append(chunk.text)
        self.token_logprobs += chunk.meta_info.output_token_logprobs or []
        self.top_logprobs += chunk.meta_info.output_top_logprobs or []


def complete(
    client: Client, args: argparse.Namespace, request: dict[str, Any], stream: bool
) -> str:
    """Prints the completions of one request (as they come with `stream`); returns the first
    one's text."""
    completions: dict[int, Completion] = defaultdict(Completion)
    chunks = client.stream(
        **request,
        sampling_params=sampling_params(args),
        return_logprob=args.logprobs or args.top_logprobs > 0,
        top_logprobs_num=args.top_logprobs,
    )
    # Closed before the client is, so that a Ctrl-C mid-stream still aborts the request.
    with contextlib.closing(chunks):
        for chunk in chunks:
            completions[chunk.index or 0].add(chunk)
            if stream:
                print(chunk.text, end="", flush=True)
    for index in sorted(completions):
        completion = completions[index]
        if len(completions) > 1:
            print(f"===== completion {index} =====")
        print("" if stream else "".join(completion.text))
        if completion.token_logprobs:
            print_logprobs(completion)
    return "".join(completions[0].text)


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for name, _, _ in SAMPLING_FLAGS] + ["stop"]
    params = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.ignore_eos:
        params["ignore_eos"] = True
    return params


def print_logprobs(completion: Completion) -> None:
    print(f"{'token_id':>9} {'logprob':>10}  top_logprobs")
    tops = completion.top_logprobs or [[] for _ in completion.token_logprobs]
    for (logprob, token_id), top in zip(completion.token_logprobs, tops):
        alternatives = " ".join(f"{tid}:{lp:.4f}" for lp, tid in top)
        print(f"{token_id:>9} {logprob:>10.4f}  {alternatives}".rstrip())


def print_json(reply: msgspec.Struct) -> None:
    # Every field, defaults too: the wire leaves out a field equal to its default (health's
    # status "ok"), which a reader of this output should still see.
    fields = {"type": type(reply).__struct_config__.tag, **msgspec.structs.asdict(reply)}
    print(msgspec.json.format(msgspec.json.encode(fields), indent=2).decode())
