"""Structured outputs: what a JSON schema costs, and what compiling a big one costs the others.

    python benchmarks/bench_structured.py [--num-requests 64 --input-len 128 --output-len 128]
                                          [--rounds 5] [--compile-kb 50] [--server-args "..."]

One server, two measurements, each side taking turns round after round (the summary compares
medians: a shared machine drifts between runs):

1. Throughput: `--num-requests` requests at once, all with one JSON schema, against the same
   requests unconstrained. The schema (an array of at least 1,000 short strings) cannot end
   within --output-len tokens and the unconstrained side ignores EOS, so both sides produce
   exactly --output-len tokens per request: the ratio is the cost of the masks per token.
2. Compile: --running-requests requests decode; one of them is timed with, one without, a request
   whose fresh --compile-kb KB schema is compiling meanwhile (new each round: no cache hit). The
   running requests' ITL p99 with the compile against without it.

Acceptance (issue 23): throughput ratio >= 0.9; ITL p99 up by at most 10% while compiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

from bench_serving import make_prompts

from radixserve.client import AsyncClient
from radixserve.client.local_server import launched_server

# An array of at least 1,000 strings of 1-6 letters: valid JSON at every step, never done early.
LONG_SCHEMA = json.dumps(
    {
        "type": "array",
        "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "minItems": 1000,
    }
)


def big_schema(kilobytes: int) -> str:
    """A schema of about `kilobytes` KB: an object of many required, typed properties (enums,
    patterns, bounded integers, nested objects), named afresh each call so it compiles anew."""
    salt = uuid.uuid4().hex[:8]
    properties: dict[str, dict] = {}
    i = 0
    while len(json.dumps(properties)) < kilobytes * 1024:
        kind = i % 4
        if kind == 0:
            prop: dict = {"enum": [f"{salt}_v{i}_{j}" for j in range(8)]}
        elif kind == 1:
            prop = {"type": "string", "pattern": f"^[a-f]{{2,{4 + i % 5}}}-[0-9]{{3}}$"}
        elif kind == 2:
            prop = {"type": "integer", "minimum": 0, "maximum": 10 + i}
        else:
            prop = {
                "type": "object",
                "properties": {"x": {"type": "boolean"}, "y": {"type": "string", "maxLength": 9}},
                "required": ["x", "y"],
            }
        properties[f"{salt}_field_{i}"] = prop
        i += 1
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


async def timed_stream(c: AsyncClient, ids: list[int], params: dict) -> tuple[int, list[float]]:
    """(tokens, arrival times of the chunks) of one streamed request."""
    times: list[float] = []
    tokens = 0
    async for chunk in c.stream(input_ids=ids, sampling_params=params):
        times.append(time.perf_counter())
        tokens += len(chunk.output_ids)
    return tokens, times


async def throughput(address: str, prompts: list[list[int]], out_len: int, schema: bool) -> float:
    params: dict = {"max_new_tokens": out_len, "temperature": 0.8, "seed": 1}
    params |= {"json_schema": LONG_SCHEMA} if schema else {"ignore_eos": True}
    async with AsyncClient(address, timeout=1800) as c:
        start = time.perf_counter()
        runs = await asyncio.gather(*(timed_stream(c, ids, params) for ids in prompts))
        duration = time.perf_counter() - start
    tokens = sum(n for n, _ in runs)
    assert tokens == out_len * len(prompts), "a request ended early: the sides would differ"
    return tokens / duration


async def running_itl_p99(
    address: str, prompts: list[list[int]], out_len: int, compile_kb: int
) -> tuple[float, float]:
    """ITL p99 of the running requests (seconds), and how long the big schema's request took
    to answer (0 without one)."""
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    # Made before the clock starts: building it (json.dumps as it grows) is the client's CPU,
    # on the server's two cores, not the server's cost.
    schema = big_schema(compile_kb) if compile_kb else ""
    async with AsyncClient(address, timeout=1800) as c:
        running = [asyncio.create_task(timed_stream(c, ids, params)) for ids in prompts]
        compile_s = 0.0
        if compile_kb:
            await asyncio.sleep(1.0)  # the running requests are decoding by now
            start = time.perf_counter()
            await c.generate(
                input_ids=prompts[0][:8],
                sampling_params={"max_new_tokens": 4, "json_schema": schema},
            )
            compile_s = time.perf_counter() - start
        runs = await asyncio.gather(*running)
    gaps = [b - a for _, times in runs for a, b in zip(times[5:], times[6:])]
    return statistics.quantiles(gaps, n=100)[98], compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--running-requests", type=int, default=16)
    parser.add_argument("--compile-kb", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    args = parser.parse_args()
    prompts = make_prompts(args.num_requests, args.input_len, vocab=49152)
    flags = ["--model", args.model, "--dtype", args.dtype, *args.server_args.split()]
    rates: dict[bool, list[float]] = {False: [], True: []}
    itls: dict[bool, list[float]] = {False: [], True: []}
    compile_times: list[float] = []
    with launched_server(*flags) as server:
        # Warm-up, untimed: the schema's one compile, and the first steps' one-time costs.
        for schema in (False, True):
            asyncio.run(throughput(server.address, prompts[:2], 4, schema))
        for _ in range(args.rounds):
            for schema in (False, True):
                rate = asyncio.run(throughput(server.address, prompts, args.output_len, schema))
                rates[schema].append(rate)
            running = prompts[: args.running_requests]
            for compiling in (False, True):
                kb = args.compile_kb if compiling else 0
                p99, took = asyncio.run(
                    running_itl_p99(server.address, running, args.output_len, kb)
                )
                itls[compiling].append(p99)
                if compiling:
                    compile_times.append(took)
    plain, constrained = (statistics.median(rates[s]) for s in (False, True))
    quiet, busy = (statistics.median(itls[c]) for c in (False, True))
    rows = [
        ["unconstrained", f"{plain:.1f}", "", f"{quiet * 1000:.1f}", ""],
        ["json_schema", f"{constrained:.1f}", f"{constrained / plain:.2f}x", "", ""],
        [f"{args.compile_kb} KB compiling", "", "", f"{busy * 1000:.1f}", f"{busy / quiet:.2f}x"],
    ]
    table = [["run", "tok/s", "vs plain", "ITL p99 (ms)", "vs quiet"], *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in [table[0], ["-" * w for w in widths], *table[1:]]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(
        f"{args.num_requests} requests x {args.output_len} tokens, medians of {args.rounds} rounds;"
        f" ITL of {args.running_requests} running requests; the big schema's request answered in"
        f" {statistics.median(compile_times):.2f} s (median)"
    )


if __name__ == "__main__":
    main()
