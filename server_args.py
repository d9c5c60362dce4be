"""The server's one typed configuration, parsed once by launch.py and handed to every process.

Importing this module must stay cheap: `launch.py --help` parses with it before anything heavy.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import typing
from typing import NoReturn

import msgspec

from radixserve.model_worker.model_source import DEFAULT_MODEL
from radixserve.protocol.wire import API_KEY_ENV, MAX_API_KEY_CHARS

DEFAULT_NUM_DRAFT_TOKENS = 8


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # the OpenAI API's model name; default: --model
    host: str = "127.0.0.1"
    port: int = 30000
    http_port: int = 30080  # 0: no HTTP server
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
    sampling_defaults: str = "model"  # model: generation_config.json fills what a request omits
    num_threads: int | None = None  # threads of each model process; default: cores / processes
    kernels: str = "auto"  # auto | torch_native | cpu_extension
    quantization: str | None = None  # None | int8
    disable_fused_layers: bool = False  # run cpu_extension's decoder layers as modules, op by op
    tp_size: int = 1  # tensor-parallel ranks, one scheduler process each
    dp_size: int = 1  # data-parallel replicas, each of --tp-size ranks
    load_balance_method: str = "round_robin"  # round_robin | cache_aware
    # cache_aware's, with the defaults of SGLang's router (sglang_router)
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of TP rank 0; default: a free local port
    enable_overlap_schedule: bool = False  # default: on with a GPU, off on the CPU
    disable_overlap_schedule: bool = False
    log_interval: int = 40  # decode steps between two log lines
    speculative_algorithm: str | None = None  # None | NGRAM | STANDALONE
    # Rows verified per request: the last token + drafts
    speculative_num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    speculative_draft_model_path: str | None = None  # STANDALONE's draft model
    speculative_num_steps: int | None = None  # STANDALONE's drafts per step; None: 3
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_disable_by_batch_size: int = 4  # more running requests: no speculation
    max_request_bytes: int = 64 * 1024 * 1024
    http_body_timeout: float = 60.0  # seconds an HTTP request's body may take to arrive
    max_queued_requests: int = 1024  # waiting requests; past it, new ones get `overloaded`
    # Before the scheduler (tokenizer_manager/intake.py): past these, `overloaded` at once.
    max_pending_requests: int = 1024
    max_pending_bytes: int = 256 * 1024 * 1024
    max_pending_requests_per_client: int = 256
    max_pending_bytes_per_client: int = 64 * 1024 * 1024
    max_reply_backlog_bytes: int = 64 * 1024 * 1024  # unread replies held for one slow client
    max_total_reply_backlog_bytes: int = 256 * 1024 * 1024  # the same, all clients together
    api_key: str | None = None
    watchdog_timeout: float = 300.0  # seconds a server process may go without a heartbeat
    shutdown_timeout: float = 0.0  # on SIGTERM, seconds in-flight requests may take to finish
    log_requests: bool = False
    check_invariants: bool = False  # verify the scheduler's invariants after every step (tests)
    log_level: str = "info"
    tool_call_parser: str | None = None  # qwen25 | llama3: tool calls in chat output
    reasoning_parser: str | None = None  # qwen3 | deepseek-r1: <think> in chat output

    @property
    def threads_per_model_process(self) -> int:
        """--num-threads, or the cores shared out among this node's model processes."""
        if self.num_threads is not None:
            return self.num_threads
        processes = self.dp_size * self.tp_size // self.nnodes
        return max(1, usable_cores() // processes)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset),
    which os.cpu_count() does not see."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one model process sits: its replica, its TP rank, and where its TP group meets."""

    dp_rank: int = 0
    tp_rank: int = 0
    dist_init_addr: str = ""  # unused with --tp-size 1

    @property
    def process_name(self) -> str:
        dp = f"_dp{self.dp_rank}" if self.dp_rank else ""
        tp = f"_tp{self.tp_rank}" if self.tp_rank else ""
        return f"scheduler{dp}{tp}"


# Every flag's help. A field whose default is None says here what it derives instead.
_HELP = {
    "model": "a local model directory (config.json, safetensors, tokenizer), a Hugging Face Hub "
    "id (the Hub when reachable, else the offline HF cache), or the bundled default model",
    "served_model_name": "the model's name in the OpenAI API (`model` of requests, "
    "/v1/models; default: --model as given)",
    "host": "address the client endpoint (a ZMQ ROUTER) binds",
    "port": "TCP port of the client endpoint",
    "http_port": "TCP port of the HTTP server (OpenAI-compatible and SGLang's native API, "
    "/metrics), on --host; 0 turns it off",
    "dtype": "weights and KV cache dtype; auto: float32 on CPUs without native bf16, bfloat16 on "
    "others (with --quantization int8 too: its activations'), the checkpoint's half precision "
    "on GPU",
    "device": "auto (cuda when there is a GPU, else cpu), cpu, cuda or cuda:N",
    "context_length": "longest prompt + output in tokens (default: the model's "
    "max_position_embeddings; more is refused unless RADIXSERVE_ALLOW_LONG_CONTEXT=1)",
    "max_total_tokens": "KV cache size in tokens (default: what fits in --mem-fraction-static, "
    "at most 262144 tokens on CPU; given, on CPU at most what the available memory holds)",
    "mem_fraction_static": "GPU: fraction of its memory for the weights and the KV cache; CPU: "
    "fraction of the memory available after loading the weights for the KV cache",
    "max_running_requests": "cap on requests running at once (default: 256, or fewer when the "
    "KV cache or --max-prefill-tokens is smaller)",
    "max_prefill_tokens": "token budget of one scheduler step: its prompt tokens plus one per "
    "decoding request (SGLang's count with --enable-mixed-chunk; here every step may mix)",
    "chunked_prefill_size": "prompt tokens prefilled in one step, over all requests; a longer "
    "prompt is prefilled in chunks while decodes go on (-1: no chunking)",
    "page_size": "prefix-cache granularity in tokens: prefixes are matched, cached and evicted "
    "in whole pages; the KV pool itself is not paged (slots are handed out one by one)",
    "disable_radix_cache": "turn off prefix sharing between requests",
    "schedule_policy": "fcfs: first come first served; lpm: longest cached prefix first",
    "random_seed": "seed of the sampler for requests without their own seed",
    # SGLang's flag and values; vLLM's --generation-config auto|vllm does the same.
    "sampling_defaults": "model: temperature, top_p, top_k, min_p and repetition_penalty that a "
    "request leaves out take the model's generation_config.json values; openai: SGLang's "
    "constant defaults (temperature 1.0, top_p 1.0, top_k -1, min_p 0.0, "
    "repetition_penalty 1.0). A value a request sends always wins",
    "num_threads": "CPU threads of each model process, one per TP rank and DP replica (default: "
    "the cores divided among this node's model processes); the other processes take one",
    "tp_size": "tensor-parallel size: the model's heads and MLP are split over this many ranks, "
    "one scheduler process each, in lockstep (gloo on the CPU, NCCL on GPUs)",
    "dp_size": "data-parallel size: this many independent replicas of the model (each of "
    "--tp-size ranks), behind one tokenizer manager and a controller that routes requests",
    "load_balance_method": "how the data-parallel controller picks a replica: round_robin, or "
    "cache_aware (SGLang's router: the replica that already holds the longest prefix of the "
    "prompt while the replicas are balanced, else the least loaded)",
    "cache_threshold": "cache_aware: the share of a prompt a replica must hold (as far as the "
    "router has seen) for its prefix to decide where the prompt goes; below it, the replica "
    "holding the fewest prompts' pages (SGLang router's flag)",
    "balance_abs_threshold": "cache_aware: route to the least-loaded replica (requests in flight) "
    "once the busiest has more than this many over the idlest, and "
    "--balance-rel-threshold times as many (SGLang router's flag)",
    "balance_rel_threshold": "cache_aware: see --balance-abs-threshold (SGLang router's flag)",
    "nnodes": "machines the TP ranks are spread over (--tp-size must be a multiple)",
    "node_rank": "this machine's rank among --nnodes; node 0 serves the clients",
    "dist_init_addr": "host:port where the TP ranks meet (node 0's address; replica i uses port + "
    "i); needed with --nnodes above 1 (default: a free port on 127.0.0.1)",
    "kernels": "what runs the whole forward (attention, linear layers, norms): cpu_extension: "
    "the CPU extension (paged attention reading the KV pool in place, fused small ops, its own "
    "linears for a few rows), float32 on the CPU, and bfloat16 where the CPU has it in hardware; "
    "torch_native: eager torch, the reference, any device; auto: "
    "cpu_extension where it applies and builds, else torch_native",
    "quantization": "int8: int8 weights and per-token int8 activations (w8a8) for every linear "
    "layer and the LM head, on the CPU (default: none)",
    "disable_fused_layers": "with cpu_extension on one rank, run the decoder layers as Python "
    "modules, one op at a time, instead of all in one call of the CPU extension (the same "
    "kernels, the same results)",
    "enable_overlap_schedule": "overlap on the CPU too: plan step N+1 (and process step N-1) "
    "while step N runs on a worker thread. With a GPU it is on unless disabled; on the CPU, "
    "where the forward's threads take every core, off unless asked for",
    "disable_overlap_schedule": "run each step's forward on the scheduler's thread and process "
    "its result before planning the next (the default on the CPU)",
    "log_interval": "decode steps between two throughput log lines",
    "speculative_algorithm": "speculative decoding: NGRAM guesses a request's next tokens from "
    "its own prompt and output (prompt lookup), STANDALONE has a smaller draft model with the "
    "same tokenizer propose them (--speculative-draft-model-path); the model verifies them in "
    "one forward; outputs are the same as without it (default: off)",
    "speculative_num_draft_tokens": "tokens verified per request and step: its last token and "
    "up to this many minus one drafts (STANDALONE: --speculative-num-steps + 1, as SGLang's "
    "chain)",
    "speculative_draft_model_path": "STANDALONE: the draft model (a directory or Hub id), run "
    "beside the model in the same process with a KV cache of its own (default: none)",
    "speculative_num_steps": "STANDALONE: draft tokens the draft model proposes per request "
    "and step, one forward each (default: 3)",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest run of a request's last tokens "
    "that must match earlier in its prompt or output to propose drafts",
    "speculative_ngram_max_match_window_size": "NGRAM: longest run of last tokens matched (the "
    "longest match wins)",
    "speculative_disable_by_batch_size": "a step speculates only while at most this many "
    "requests run: at larger batches the extra rows cost real compute",
    "max_request_bytes": "largest request frame; a client sending a larger one is disconnected",
    "http_body_timeout": "seconds an HTTP request's body may take to arrive, from its headers; "
    "past it, 408 (a body that never comes must not hold its place among the pending requests)",
    "max_queued_requests": "requests that may wait for admission; past it, new ones get an "
    "`overloaded` error",
    "max_pending_requests": "generates received but not yet handed to the scheduler (being "
    "tokenized, or HTTP bodies being read), all clients together; past it, new ones get an "
    "`overloaded` error (503 with Retry-After over HTTP) at once",
    "max_pending_bytes": "the same in bytes (a prompt's size): the memory requests may hold "
    "before the scheduler",
    "max_pending_requests_per_client": "--max-pending-requests for one client (a ZMQ "
    "connection, or an HTTP client's address)",
    "max_pending_bytes_per_client": "--max-pending-bytes for one client",
    "max_reply_backlog_bytes": "replies held for a client that reads slower than it asks; past "
    "it, that client's requests are aborted with an `overloaded` error",
    "max_total_reply_backlog_bytes": "replies held for all slow clients together; past it, the "
    "requests of the client with the most unread are aborted with an `overloaded` error",
    "api_key": "require this key of every request but a health check: in the `api_key` field "
    "over ZMQ, as `Authorization: Bearer KEY` over HTTP (default: $RADIXSERVE_API_KEY, which "
    "unlike a flag does not show in `ps`; else none)",
    "watchdog_timeout": "seconds a server process may go without a heartbeat before the server "
    "is stopped as hung",
    "shutdown_timeout": "on SIGTERM, seconds that requests in flight may take to finish before "
    "they are aborted (0: abort at once)",
    "log_requests": "log one line per finished, aborted or failed request",
    "check_invariants": "verify the scheduler's invariants after every step (slow; for tests)",
    "log_level": "logging level of every server process",
    "tool_call_parser": "turn the model's tool calls in chat output into OpenAI's `tool_calls`: "
    "qwen25 (<tool_call>{json}</tool_call>, Qwen2.5 and Qwen3) or llama3 (JSON with `name` and "
    "`parameters`, <|python_tag|>) (default: none; chat output stays text)",
    "reasoning_parser": "split the model's thinking from its answer in chat output, into "
    "`reasoning_content`: qwen3 or deepseek-r1 (<think>...</think>) (default: none)",
}

# Flags whose values form a closed set: argparse refuses others before anything starts.
_CHOICES = {
    "dtype": ("auto", "bfloat16", "float16", "float32"),
    "schedule_policy": ("fcfs", "lpm"),
    "speculative_algorithm": ("NGRAM", "STANDALONE"),
    "sampling_defaults": ("model", "openai"),
    "kernels": ("auto", "torch_native", "cpu_extension"),
    "quantization": ("int8",),
    "load_balance_method": ("round_robin", "cache_aware"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "tool_call_parser": ("qwen25", "llama3"),
    "reasoning_parser": ("qwen3", "deepseek-r1"),
}


# The range of every number: (least, greatest), None where open. Checked before any process starts.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "port": (1, 65535),
    "http_port": (0, 65535),
    "context_length": (1, None),
    "max_total_tokens": (1, None),
    "mem_fraction_static": (0.01, 1.0),
    "max_running_requests": (1, None),
    "max_prefill_tokens": (1, None),
    "chunked_prefill_size": (-1, None),  # and not 0, below
    "page_size": (1, None),
    "random_seed": (0, 2**64 - 1),
    "num_threads": (1, None),
    "tp_size": (1, None),
    "dp_size": (1, None),
    "nnodes": (1, None),
    "node_rank": (0, None),
    "log_interval": (1, None),
    "max_request_bytes": (1024, None),
    "http_body_timeout": (0.1, None),
    "max_queued_requests": (1, None),
    "max_reply_backlog_bytes": (1, None),
    "max_total_reply_backlog_bytes": (1, None),
    # Twice the heartbeat interval (process_setup.HEARTBEAT_INTERVAL_S): a live child beats
    # at least once per timeout.
    "watchdog_timeout": (1.0, None),
    "max_pending_requests": (1, None),
    "max_pending_bytes": (1024, None),
    "max_pending_requests_per_client": (1, None),
    "max_pending_bytes_per_client": (1024, None),
    "cache_threshold": (0.0, 1.0),
    "balance_abs_threshold": (0, None),
    "balance_rel_threshold": (1.0, None),
    "shutdown_timeout": (0.0, None),
}


def check_server_args(args: ServerArgs) -> str | None:
    """Why these flags cannot serve, or None: every number in its range, the flags that must
    agree with each other. What needs the model or the machine is checked by launch.py."""
    for name, (least, greatest) in _RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            return f"{flag} must be a finite number, not {value}"
        if least is not None and value < least:
            return f"{flag} must be at least {least}, not {value}"
        if greatest is not None and value > greatest:
            return f"{flag} must be at most {greatest}, not {value}"
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device) is None:
        return f"--device must be auto, cpu, cuda or cuda:N, not {args.device!r}"
    if args.chunked_prefill_size == 0:
        return "--chunked-prefill-size must be -1 (no chunking) or at least 1, not 0"
    if args.http_port == args.port:
        return f"--port and --http-port are both {args.port}"
    # An empty key would turn authentication off in silence.
    if args.api_key is not None and not 0 < len(args.api_key) <= MAX_API_KEY_CHARS:
        return f"--api-key must have 1 to {MAX_API_KEY_CHARS} characters"
    # An empty name would fall back to --model's in silence.
    if args.served_model_name is not None and not args.served_model_name.strip():
        return "--served-model-name must not be empty"
    if args.enable_overlap_schedule and args.disable_overlap_schedule:
        return "--enable-overlap-schedule and --disable-overlap-schedule contradict each other"
    return check_parallel_args(args) or check_speculative_args(args)


def check_parallel_args(args: ServerArgs) -> str | None:
    """Why the parallel flags do not fit together, or None."""
    if min(args.tp_size, args.dp_size, args.nnodes) < 1:
        return "--tp-size, --dp-size and --nnodes must be at least 1"
    if args.tp_size % args.nnodes:
        return f"--tp-size {args.tp_size} does not split over --nnodes {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}"
    if args.nnodes > 1 and args.dist_init_addr is None:
        return "--nnodes above 1 needs --dist-init-addr (node 0's host:port)"
    if args.dist_init_addr is not None:
        return _dist_init_addr_mistake(args)
    return None


def _dist_init_addr_mistake(args: ServerArgs) -> str | None:
    """--dist-init-addr's mistakes, found before loading: torch's store found them after it,
    a port past 65535 or no host as a traceback, the client endpoint's own port as a bind
    error."""
    host, _, port = (args.dist_init_addr or "").rpartition(":")
    if not host or not port.isdigit() or len(port) > 5:
        return f"--dist-init-addr {args.dist_init_addr!r} is not host:port"
    ports = range(int(port), int(port) + args.dp_size)  # replica i meets at port + i
    first, last = ports.start, ports.stop - 1
    if first < 1 or last > 65535:
        given = f"--dist-init-addr {args.dist_init_addr!r}"
        return f"{given}: ports {first}-{last} are not all in 1-65535"
    for flag, taken in (("--port", args.port), ("--http-port", args.http_port)):
        if taken in ports and args.node_rank == 0:
            return f"--dist-init-addr {args.dist_init_addr!r} takes {flag} {taken}"
    return None


# Other spellings of a flag that users of SGLang or vLLM type: the same flag.
_ALIASES = {
    "model": ("--model-path",),  # SGLang's
    "context_length": ("--max-model-len",),  # vLLM's
    "tp_size": ("--tensor-parallel-size",),  # vLLM's
    "dp_size": ("--data-parallel-size",),  # vLLM's
    "random_seed": ("--seed",),  # vLLM's
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field, named as SGLang names it (--max-total-tokens, ...), and the other
    spellings of _ALIASES."""
    for field in msgspec.structs.fields(ServerArgs):
        flag = "--" + field.name.replace("_", "-")
        flags = (flag, *_ALIASES.get(field.name, ()))
        default = field.default
        help_text = _HELP.get(field.name)  # None when missing: tests/test_launch.py catches it
        if help_text is not None and default is not None:
            help_text += " (default: off)" if default is False else " (default: %(default)s)"
        if isinstance(default, bool):
            parser.add_argument(*flags, action="store_true", help=help_text)
            continue
        # An optional field's None means "derive it" (or "off"); its flag takes the other type.
        kind = type(default) if default is not None else typing.get_args(field.type)[0]
        spelled = _VALUE_SPELLINGS.get(field.name)
        parser.add_argument(
            *flags,
            dest=field.name,
            type=kind if spelled is None else spelled,
            default=default,
            choices=_CHOICES.get(field.name),
            help=help_text,
        )


def _dtype(value: str) -> str:
    return {"half": "float16", "float": "float32"}.get(value, value)  # SGLang's and vLLM's too


# Values SGLang or vLLM also take, in our spelling, before the choices are checked.
_VALUE_SPELLINGS = {"dtype": _dtype, "log_level": str.lower}


MAX_SPECULATIVE_TOKENS = 64  # verified rows per request and step
MAX_NGRAM_WINDOW = 64


STANDALONE_DEFAULT_STEPS = 3  # SGLang's choice when a draft model's steps are not given


def speculative_num_draft_tokens(args: ServerArgs) -> int:
    """Rows verified per request and step. STANDALONE drafts a chain (SGLang's topk 1), whose
    length is its steps: --speculative-num-steps + 1 (SGLang adjusts the flag to that)."""
    if args.speculative_algorithm == "STANDALONE":
        return (args.speculative_num_steps or STANDALONE_DEFAULT_STEPS) + 1
    return args.speculative_num_draft_tokens


def check_speculative_args(args: ServerArgs) -> str | None:
    """Why the speculative flags do not fit together, or None."""
    if not 2 <= args.speculative_num_draft_tokens <= MAX_SPECULATIVE_TOKENS:
        return f"--speculative-num-draft-tokens must be in 2..{MAX_SPECULATIVE_TOKENS}"
    standalone = args.speculative_algorithm == "STANDALONE"
    draft_model = args.speculative_draft_model_path
    if standalone != (draft_model is not None):
        return "--speculative-algorithm STANDALONE and --speculative-draft-model-path go together"
    steps = args.speculative_num_steps
    if steps is not None:
        if not standalone:
            return "--speculative-num-steps is STANDALONE's (a draft model's steps)"
        if not 1 <= steps < MAX_SPECULATIVE_TOKENS:
            return f"--speculative-num-steps must be in 1..{MAX_SPECULATIVE_TOKENS - 1}"
    if standalone:
        given = args.speculative_num_draft_tokens
        chain = speculative_num_draft_tokens(args)
        if given not in (DEFAULT_NUM_DRAFT_TOKENS, chain):
            return (
                f"--speculative-num-draft-tokens {given} with STANDALONE: a draft model proposes "
                f"a chain, --speculative-num-steps + 1 = {chain} tokens"
            )
        if args.tp_size > 1:
            return "--speculative-algorithm STANDALONE runs with --tp-size 1 only"
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    if not 1 <= low <= high <= MAX_NGRAM_WINDOW:
        return (
            "--speculative-ngram-min-match-window-size and -max- must satisfy "
            f"1 <= min <= max <= {MAX_NGRAM_WINDOW}"
        )
    if args.speculative_disable_by_batch_size < 1:
        return "--speculative-disable-by-batch-size must be at least 1"
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the usage of 40 flags above it; exit code 2 as argparse's."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="radixserve",
        description="Serve an LLM: clients send msgpack requests over ZMQ to tcp://HOST:PORT, "
        "or HTTP (OpenAI's API) to http://HOST:HTTP_PORT. "
        "Ctrl-C or SIGTERM stops every process.",
    )
    add_cli_args(parser)
    for flag, says in _REFUSED_FLAGS.items():
        parser.add_argument(flag, action=_RefusedFlag, says=says)
    return parser


# Flags refused with what to use instead: our own old spellings, and SGLang's or vLLM's that
# have no place here.
_REFUSED_FLAGS = {
    "--attention-backend": "is now --kernels (it picks every kernel of the forward, not "
    "attention's alone; cpu_attn is cpu_extension)",
    "--torch-threads": "is now --num-threads",
    # SGLang's or vLLM's, which an old command line brings along
    "--gpu-memory-utilization": "is vLLM's: use --mem-fraction-static",
    "--trust-remote-code": "is not needed: radixserve runs its own code for Llama, Qwen2 and "
    "Qwen3 checkpoints, and never a model's remote code",
    "--tokenizer": "is not served: the tokenizer is --model's own",
    "--chat-template": "is not served: the chat template is --model's own",
    "--enable-metrics": "is not needed: /metrics is always served",
    "--disable-log-requests": "is not needed: requests are logged only with --log-requests",
}


class _RefusedFlag(argparse.Action):
    """Not in --help and never a field: given, it ends the parse saying what to use."""

    def __init__(self, option_strings: list[str], dest: str, says: str, **_: object):
        super().__init__(
            option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        self.says = says

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        parser.error(f"{option_string} {self.says}")


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    """The flags, checked: a mistake exits with argparse's one-line error and code 2."""
    parser = build_parser()
    args = ServerArgs(**vars(parser.parse_args(argv)))
    if args.api_key is None and API_KEY_ENV in os.environ:
        args = msgspec.structs.replace(args, api_key=os.environ[API_KEY_ENV])
    mistake = check_server_args(args)
    if mistake is not None:
        parser.error(mistake)
    return args


def usage_error(message: str) -> NoReturn:
    """A flag that does not fit the model or the machine, found after parsing: the same
    one-line error and exit code 2 as a flag argparse refuses."""
    build_parser().error(message)
