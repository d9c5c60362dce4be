"""Speculative decoding on and off: two servers on the same model, taking turns in one run.

    python benchmarks/bench_spec.py [--rounds 3 --edit-requests 8 --chat-requests 8
                                     --output-len 256 --num-requests 64]
                                    [--algorithm NGRAM | --algorithm STANDALONE --draft-model PATH]
                                    [--spec-args "--speculative-num-draft-tokens 8"]

Workloads, built deterministically from what ships with Python and the model's chat template:
- edit: one request at a time, "fix the spelling in this passage" over stdlib docstrings and
  "rewrite this function with type hints" over stdlib functions' source (inspect.getsource):
  answers that copy their input, where prompt lookup pays.
- chat: one request at a time, open questions with little to copy.
- N at once: bench_serving's random prompts, all at once, ignore_eos: the throughput workload,
  which speculation must not slow down (the step decides from the batch size).
edit and chat stop where the model ends its answer (at most --output-len tokens); both servers
must give the same greedy tokens, which the run checks. Reported per workload and server: output
tokens/s, TTFT, mean ITL, and the speculating server's accept length (tokens per verifying
request step, from the servers' counters). On a shared machine one run can be 10% off the next:
compare the medians. STANDALONE's draft model must share the model's tokenizer (e.g.
SmolLM2-135M-Instruct drafting for SmolLM2-360M-Instruct or 1.7B).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import textwrap
import time
from contextlib import ExitStack
from typing import Any

from bench_serving import RequestTiming, RunResult, make_prompts, print_table, run_load

from radixserve.client import AsyncClient
from radixserve.client.local_server import launched_server
from radixserve.model_worker.model_source import resolve_model_path

# Passages and functions of the standard library, in a fixed order.
DOC_SOURCES: list[Any] = [
    json,
    textwrap,
    statistics,
    inspect.getsource,
    json.dumps,
    textwrap.wrap,
    argparse.ArgumentParser,
    statistics.median,
]
FUNCTIONS: list[Any] = [
    textwrap.dedent,
    textwrap.indent,
    statistics.median,
    statistics.mode,
    json.dump,
    inspect.cleandoc,
    inspect.getmodulename,
    argparse._get_action_name,  # type: ignore[attr-defined]
]
CHAT_QUESTIONS = [
    "Why is the sky blue?",
    "Write a short poem about the sea in autumn.",
    "What should I pack for a weekend hiking trip?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "How do bees make honey?",
    "Describe a good morning routine.",
    "What are the pros and cons of living in a big city?",
    "Tell me a story about a robot who learns to paint.",
]
MAX_PASSAGE_CHARS = 1500  # the prompts stay around 400 tokens


def edit_prompts(n: int) -> list[str]:
    """Alternately a spelling fix of a docstring (with a few letters swapped in) and a type-hint
    rewrite of a function."""
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            doc = inspect.getdoc(DOC_SOURCES[i // 2 % len(DOC_SOURCES)]) or ""
            passage = misspell(doc[:MAX_PASSAGE_CHARS])
            prompts.append(
                "Fix the spelling in this passage. Reply with the corrected passage only.\n\n"
                + passage
            )
        else:
            source = inspect.getsource(FUNCTIONS[i // 2 % len(FUNCTIONS)])[:MAX_PASSAGE_CHARS]
            prompts.append(
                "Rewrite this Python function with type hints. Reply with the code only.\n\n"
                + source
            )
    return prompts


def misspell(text: str) -> str:
    """Every 9th word of more than 4 letters with two inner letters swapped (deterministic)."""
    words = text.split(" ")
    for i in range(0, len(words), 9):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


async def answer(address: str, ids: list[int], max_new: int) -> tuple[RequestTiming, list[int]]:
    """One greedy streamed request, ending where the model ends (or at max_new)."""
    params = {"max_new_tokens": max_new, "temperature": 0}
    timing = RequestTiming(sent=time.perf_counter())
    tokens: list[int] = []
    async with AsyncClient(address, timeout=1800) as c:
        async for chunk in c.stream(input_ids=ids, sampling_params=params):
            timing.chunks.append(time.perf_counter())
            timing.tokens += len(chunk.output_ids)
            tokens += chunk.output_ids
    return timing, tokens


def one_at_a_time(
    address: str, prompts: list[list[int]], max_new: int, name: str
) -> tuple[RunResult, list[list[int]]]:
    runs = [asyncio.run(answer(address, p, max_new)) for p in prompts]
    timings = [t for t, _ in runs]
    result = RunResult(
        name=name,
        duration=sum(t.chunks[-1] - t.sent for t in timings),
        output_tokens=sum(t.tokens for t in timings),
        ttfts=[t.ttft for t in timings],
        itls=[(t.chunks[-1] - t.chunks[0]) / max(t.tokens - 1, 1) for t in timings],
    )
    return result, [tokens for _, tokens in runs]


async def spec_counters(address: str) -> tuple[int, int]:
    async with AsyncClient(address, timeout=60) as c:
        info = await c.server_info()
    return info.spec_verifies, info.spec_accepted_tokens


def accept_length(before: tuple[int, int], after: tuple[int, int]) -> str:
    verifies, accepted = after[0] - before[0], after[1] - before[1]
    return f"{1 + accepted / verifies:.2f}" if verifies else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--edit-requests", type=int, default=8)
    parser.add_argument("--chat-requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=256, help="most tokens of an answer")
    parser.add_argument("--num-requests", type=int, default=64, help="of the at-once workload")
    parser.add_argument("--input-len", type=int, default=128, help="of the at-once workload")
    parser.add_argument("--at-once-output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-args", default="", help="extra flags of both servers")
    parser.add_argument("--algorithm", default="NGRAM", choices=("NGRAM", "STANDALONE"))
    parser.add_argument("--draft-model", help="STANDALONE's draft model (a directory or Hub id)")
    parser.add_argument("--spec-args", default="", help="extra flags of the speculating server")
    args = parser.parse_args()
    if (args.algorithm == "STANDALONE") != (args.draft_model is not None):
        parser.error("--algorithm STANDALONE takes --draft-model, and only it")
    spec = args.algorithm

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    workloads = {
        "edit": chat_ids(tokenizer, edit_prompts(args.edit_requests)),
        "chat": chat_ids(tokenizer, (CHAT_QUESTIONS * args.chat_requests)[: args.chat_requests]),
    }
    at_once = make_prompts(args.num_requests, args.input_len, len(tokenizer))
    at_once_name = f"{args.num_requests} at once"
    # No prefix cache: each run computes its prompts, as the first one did.
    common = ["--model", args.model, "--dtype", args.dtype, "--disable-radix-cache"]
    common += args.server_args.split()
    draft_flags = ["--speculative-draft-model-path", args.draft_model] if args.draft_model else []
    modes = {
        spec: ["--speculative-algorithm", spec, *draft_flags, *args.spec_args.split()],
        "off": [],
    }
    results: dict[tuple[str, str], list[RunResult]] = {}
    accept: dict[tuple[str, str], list[str]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    with ExitStack() as stack:
        servers = {
            mode: stack.enter_context(launched_server(*common, *flags))
            for mode, flags in modes.items()
        }
        for round_ in range(args.rounds):
            for mode in list(servers)[:: 1 if round_ % 2 == 0 else -1]:
                address = servers[mode].address
                for load, prompts in workloads.items():
                    before = asyncio.run(spec_counters(address))
                    result, tokens = one_at_a_time(address, prompts, args.output_len, mode)
                    results.setdefault((load, mode), []).append(result)
                    accept.setdefault((load, mode), []).append(
                        accept_length(before, asyncio.run(spec_counters(address)))
                    )
                    outputs[(load, mode)] = tokens
                before = asyncio.run(spec_counters(address))
                result = asyncio.run(run_load(address, at_once, args.at_once_output_len, mode))
                results.setdefault((at_once_name, mode), []).append(result)
                accept.setdefault((at_once_name, mode), []).append(
                    accept_length(before, asyncio.run(spec_counters(address)))
                )

    print(
        f"\n{args.model}, dtype {args.dtype}, {args.rounds} rounds; edit and chat one request at "
        f"a time (at most {args.output_len} tokens each, greedy), {at_once_name} "
        f"({args.input_len} + {args.at_once_output_len} tokens, ignore_eos)\n"
    )
    for load in workloads:
        same = sum(a == b for a, b in zip(outputs[(load, spec)], outputs[(load, "off")]))
        print(f"{load}: greedy outputs equal on {same} of {len(workloads[load])} prompts")
    print()
    rows = []
    for (load, mode), runs in results.items():
        for i, r in enumerate(runs):
            rows.append([f"{load}, {mode}, round {i + 1}", *r.row()[1:], accept[(load, mode)][i]])
    print_table(rows, ["accept len"])
    print()
    for load in [*workloads, at_once_name]:
        on, off = results[(load, spec)], results[(load, "off")]
        tput = statistics.median(r.throughput for r in on) / statistics.median(
            r.throughput for r in off
        )
        itl = statistics.median(statistics.mean(r.itls) for r in on) / statistics.median(
            statistics.mean(r.itls) for r in off
        )
        print(
            f"{load}: output tok/s {spec} / off {tput:.2f}x (medians), mean ITL {itl:.2f}x, "
            f"accept len {', '.join(accept[(load, spec)])}"
        )


if __name__ == "__main__":
    main()
