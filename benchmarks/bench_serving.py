"""Serving benchmark: N concurrent requests through the client, against transformers' `generate`
with static padded batches on the same prompts, in the same run.

    python benchmarks/bench_serving.py [--num-requests 64 --input-len 128 --output-len 128]
                                       [--rounds 3] [--mixed-sampling]

Every request uses ignore_eos, so both sides produce exactly output-len tokens per request. The
two sides take turns, round after round: one server is started, and while it idles (its processes
sleep on their sockets) the baseline runs in this process. On a shared 2-core machine one run can
be 10% off the next, so the summary compares the medians over the rounds. With --mixed-sampling
the server also runs the same prompts with half of the requests sampling (temperature, top-p,
top-k, penalties) in each round, to compare with its all-greedy run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from radixserve.client import AsyncClient
from radixserve.client.local_server import launched_server
from radixserve.model_worker.model_source import resolve_model_path


@dataclass
class RequestTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each streamed chunk
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent


@dataclass
class RunResult:
    name: str
    duration: float
    output_tokens: int
    ttfts: list[float]
    itls: list[float]  # per request: mean time between tokens after the first

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.duration

    def row(self) -> list[str]:
        q = statistics.quantiles(self.ttfts, n=100)
        return [
            self.name,
            f"{self.throughput:.1f}",
            f"{statistics.median(self.ttfts):.2f}",
            f"{q[98]:.2f}",
            f"{statistics.mean(self.itls) * 1000:.0f}",
            f"{self.duration:.1f}",
        ]


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


GREEDY = {"temperature": 0}
SAMPLED = {
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.2,
}


async def run_load(
    address: str,
    prompts: list[list[int]],
    output_len: int,
    name: str = "radixserve",
    mixed: bool = False,
) -> RunResult:
    """Send every prompt at once, streaming; time each request's chunks. mixed: odd requests
    sample with SAMPLED instead of decoding greedily."""

    async def one(c: AsyncClient, i: int, ids: list[int]) -> RequestTiming:
        params = {
            "max_new_tokens": output_len,
            "ignore_eos": True,
            **(SAMPLED if mixed and i % 2 else GREEDY),
        }
        timing = RequestTiming(sent=time.perf_counter())
        async for chunk in c.stream(input_ids=ids, sampling_params=params):
            timing.chunks.append(time.perf_counter())
            timing.tokens += len(chunk.output_ids)
        return timing

    async with AsyncClient(address, timeout=1800) as c:
        start = time.perf_counter()
        timings = await asyncio.gather(*(one(c, i, ids) for i, ids in enumerate(prompts)))
        duration = time.perf_counter() - start
    return RunResult(
        name=name,
        duration=duration,
        output_tokens=sum(t.tokens for t in timings),
        ttfts=[t.ttft for t in timings],
        itls=[(t.chunks[-1] - t.chunks[0]) / max(t.tokens - 1, 1) for t in timings],
    )


class TransformersBaseline:
    """Static batching: each batch is left-padded, prefilled together, decoded to the end."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        path = resolve_model_path(args.model)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.args = args

    def run(self, prompts: list[list[int]]) -> RunResult:
        from transformers import LogitsProcessor, LogitsProcessorList

        args, model = self.args, self.model
        pad = model.config.pad_token_id or 0

        class FirstTokenClock(LogitsProcessor):
            """Called once per generated token; the first call marks the end of the prefill."""

            def __init__(self) -> None:
                self.first: float | None = None

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.first = self.first or time.perf_counter()
                return scores

        ttfts, itls, tokens = [], [], 0
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), args.baseline_batch_size):
                batch = prompts[i : i + args.baseline_batch_size]
                width = max(map(len, batch))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                clock = FirstTokenClock()
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len,
                    logits_processor=LogitsProcessorList([clock]),
                    pad_token_id=pad,
                )
                end = time.perf_counter()
                new = out.shape[1] - width
                tokens += new * len(batch)
                ttfts += [clock.first - start] * len(batch)  # every request arrived at `start`
                itls += [(end - clock.first) / max(new - 1, 1)] * len(batch)
        name = "transformers generate"
        return RunResult(name, time.perf_counter() - start, tokens, ttfts, itls)


def run_rounds(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[RunResult]]:
    """Each round: the server's run(s), then the baseline's. Results by run name."""
    server_args = ["--model", args.model, "--dtype", args.dtype, *args.server_args.split()]
    # The cache would serve a later run's prompts: each run must compute its own.
    server_args.append("--disable-radix-cache")
    baseline = TransformersBaseline(args)
    results: dict[str, list[RunResult]] = {}
    with launched_server(*server_args) as server:
        for _ in range(args.rounds):
            runs = [run_load(server.address, prompts, args.output_len)]
            if args.mixed_sampling:
                name = "radixserve, half sampled"
                runs.append(run_load(server.address, prompts, args.output_len, name, True))
            for run in runs:
                result = asyncio.run(run)
                results.setdefault(result.name, []).append(result)
            result = baseline.run(prompts)
            results.setdefault(result.name, []).append(result)
    return results


def median_throughput(results: list[RunResult]) -> float:
    return statistics.median(r.throughput for r in results)


def print_table(rows: list[list[str]], extra: list[str] = ()) -> None:
    header = [
        "run",
        "output tok/s",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "ITL mean (ms)",
        "total (s)",
        *extra,
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--baseline-batch-size", type=int, default=64)
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    parser.add_argument("--threads", type=int, default=None, help="baseline torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes")
    parser.add_argument(
        "--mixed-sampling",
        action="store_true",
        help="also run half of the requests with sampling parameters",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(resolve_model_path(args.model)))
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    results = run_rounds(args, prompts)
    print(
        f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} new tokens)"
        f", {args.dtype}, baseline batch size {args.baseline_batch_size}, "
        f"torch threads {torch.get_num_threads()}, {args.rounds} rounds\n"
    )
    print_table(
        [
            [f"{name}, round {i + 1}", *r.row()[1:]]
            for name, rs in results.items()
            for i, r in enumerate(rs)
        ]
    )
    ours = results["radixserve"]
    baseline = results["transformers generate"]
    per_round = ", ".join(f"{a.throughput / b.throughput:.2f}" for a, b in zip(ours, baseline))
    ratio = median_throughput(ours) / median_throughput(baseline)
    print(f"\nmedian throughput: radixserve {median_throughput(ours):.1f} tok/s, ", end="")
    print(f"transformers {median_throughput(baseline):.1f} tok/s")
    print(f"throughput ratio radixserve / transformers (medians): {ratio:.2f}x")
    print(f"per round: {per_round}")
    mixed = results.get("radixserve, half sampled")
    if mixed:
        ratio = median_throughput(mixed) / median_throughput(ours)
        print(f"throughput ratio half sampled / all greedy (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
