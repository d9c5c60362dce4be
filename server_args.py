"""The server's one typed configuration, parsed once by launch.py and handed to every process."""

from __future__ import annotations

import argparse

import msgspec

from radixserve.model_worker.model_source import DEFAULT_MODEL


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"  # auto: float32 on CPUs without native bf16, the checkpoint's on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_total_tokens: int | None = None  # KV pool size in tokens; default from memory
    mem_fraction_static: float = 0.85  # GPU memory fraction for weights + KV pool
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384  # token budget of one step, decodes included
    chunked_prefill_size: int = 2048  # prompt tokens computed in one step; -1: no chunking
    page_size: int = 1  # prefix-cache granularity only: the KV pool hands out single slots
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest prefix match first)
    random_seed: int = 0
    torch_threads: int | None = None  # model process threads; default: all cores
    log_interval: int = 40  # decode steps between two log lines
    max_request_bytes: int = 64 * 1024 * 1024
    check_invariants: bool = False  # verify the scheduler's invariants after every step (tests)
    log_level: str = "info"


_HELP = {
    "model": "local directory, Hugging Face id, or the bundled default",
    "dtype": "auto | bfloat16 | float16 | float32",
    "device": "auto | cpu | cuda",
    "max_total_tokens": "KV cache size in tokens",
    "max_prefill_tokens": "token budget of one scheduler step: its prompt tokens plus one per "
    "decoding request (SGLang's count with --enable-mixed-chunk; here every step may mix)",
    "page_size": "prefix-cache granularity in tokens: prefixes are matched, cached and evicted "
    "in whole pages; the KV pool itself is not paged (slots are handed out one by one)",
    "chunked_prefill_size": "prompt tokens prefilled in one step, over all requests; a longer "
    "prompt is prefilled in chunks (-1: no chunking)",
    "schedule_policy": "fcfs | lpm (longest prefix match first)",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field, named as SGLang names it (--max-total-tokens, ...)."""
    for field in msgspec.structs.fields(ServerArgs):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=_HELP.get(field.name))
            continue
        # Every optional field is an int whose None means "derive it".
        kind = int if default is None else type(default)
        parser.add_argument(flag, type=kind, default=default, help=_HELP.get(field.name))


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="radixserve", description="Serve an LLM over ZMQ.")
    add_cli_args(parser)
    ns = parser.parse_args(argv)
    return ServerArgs(**vars(ns))
