"""Model-only benchmark: our scheduler and model runner in this process (no sockets, no other
processes) against transformers' forward with its DynamicCache, step by step, interleaved.

    python benchmarks/bench_forward.py [--num-requests 64 --input-len 128 --steps 60]

Both sides prefill the same prompts (ours in the steps --chunked-prefill-size allows, decodes of
the first requests included; transformers in one padded batch), then decode greedily, one step
of each side after the other so that a slow moment of the machine hits both. Prints the prefill
time and the median decode step of each side: what bench_serving.py's figures are made of, less
the serving around them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_serving import make_prompts

from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory
from radixserve.protocol.internal import TokenizedGenerateReq
from radixserve.protocol.wire import SamplingParams
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig


def our_scheduler(path: str, args: argparse.Namespace) -> Scheduler:
    tokens = args.num_requests * (args.input_len + args.steps + 8)
    runner = ModelRunner(
        path,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=tokens,
        mem_fraction_static=0.8,
        tp=TPGroup(rank=0, size=1, group=None),
        seed=0,
    )
    config = SchedulerConfig(
        max_total_tokens=tokens,
        max_running_requests=args.num_requests,
        max_prefill_tokens=16384,
        chunked_prefill_size=args.chunked_prefill_size,
        context_len=runner.model_config.max_position_embeddings,
        eos_token_ids=frozenset(),
        enable_radix_cache=False,
    )
    return Scheduler(config, runner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60, help="decode steps timed")
    parser.add_argument("--chunked-prefill-size", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(2)
    keep_freed_memory()  # as the server's model process does

    from transformers import AutoModelForCausalLM, DynamicCache

    path = resolve_model_path(args.model)
    prompts = make_prompts(args.num_requests, args.input_len, vocab=49152)
    ours = our_scheduler(path, args)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        ours.add_request(TokenizedGenerateReq(f"r{i}", ids, params, stream=True))

    with torch.inference_mode():
        start = time.perf_counter()
        while ours.waiting or any(not r.is_decoding for r in ours.running):
            ours.step()
            ours.outbox = []
        ours_prefill = time.perf_counter() - start

        start = time.perf_counter()
        cache = DynamicCache(config=hf.config)
        logits = hf(torch.tensor(prompts), past_key_values=cache, logits_to_keep=1).logits
        hf_prefill = time.perf_counter() - start

        ours_steps, hf_steps = [], []
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.steps):
            start = time.perf_counter()
            logits = hf(next_ids, past_key_values=cache).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            hf_steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            ours.step()
            ours.outbox = []
            ours_steps.append(time.perf_counter() - start)

    print(
        f"\n{args.num_requests} sequences x {args.input_len} prompt tokens, float32, "
        f"torch threads 2, {args.steps} decode steps from context {args.input_len}\n"
    )
    print("| side | prefill (s) | decode step, median (ms) |")
    print("|---|---|---|")
    for name, prefill, steps in (
        ("radixserve (in-process)", ours_prefill, ours_steps),
        ("transformers forward", hf_prefill, hf_steps),
    ):
        print(f"| {name} | {prefill:.2f} | {statistics.median(steps) * 1e3:.0f} |")
    ratio = statistics.median(hf_steps) / statistics.median(ours_steps)
    print(f"\nprefill speed ratio ours / transformers: {hf_prefill / ours_prefill:.2f}x")
    print(f"decode speed ratio ours / transformers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
