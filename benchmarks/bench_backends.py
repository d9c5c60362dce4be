"""Kernels and quantization on the default model, in this process: greedy outputs of each
configuration against torch_native float32 (the reference), and their step times, taking turns.

    python benchmarks/bench_backends.py [--prompts 32 --new-tokens 64 --batch 64 --steps 20]

Configurations: `--kernels torch_native`, `cpu_extension` with its layers run as modules
op by op (`--disable-fused-layers`) and in one call (the default), and `cpu_extension` with
`--quantization int8`. Accuracy, on 32 chat prompts: the greedy continuations (64 tokens)
compared with the reference's, and, teacher-forced on the reference's continuation, how often
each configuration's argmax is the reference's token (greedy agreement) and the mean |Δ logprob|
of those tokens. Speed: the decode step at 1 sequence and at --batch sequences of 128-token
prompts, and the prefill of those prompts, the configurations' steps interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from bench_serving import make_prompts
from weight_streaming import weight_streaming_seconds

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

# name: (kernels, quantization, fused layers)
CONFIGS = {
    "torch_native": ("torch_native", None, False),
    "cpu_extension, modules": ("cpu_extension", None, False),
    "cpu_extension": ("cpu_extension", None, True),
    "cpu_extension + int8": ("cpu_extension", "int8", True),
}
TOPICS = ["the moon", "bread", "a bicycle", "rain", "chess", "the ocean", "music", "a library"]
ASKS = [
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
]


@dataclass
class Seqs:
    """Sequences of one configuration's pool: tokens so far and how many are in the pool."""

    tokens: list[list[int]]
    computed: list[int]
    max_len: int

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end) + 1 + i * self.max_len  # slot 0 is padding


def forward(runner: ModelRunner, seqs: Seqs, rows: list[int], all_rows: bool = False):
    """One forward computing each listed sequence's tokens not yet in the pool; float32 logits
    of every new token (all_rows) or of each sequence's last."""
    prefix = torch.tensor([seqs.computed[i] for i in rows])
    ends = torch.tensor([len(seqs.tokens[i]) for i in rows])
    starts, stops = prefix.tolist(), ends.tolist()
    kv_slots = torch.zeros(len(rows), int(ends.max()), dtype=torch.int64)
    for r, i in enumerate(rows):
        kv_slots[r, : ends[r]] = seqs.slots(i, 0, int(ends[r]))
    batch = ModelWorkerBatch(
        input_ids=torch.tensor([t for i in rows for t in seqs.tokens[i][seqs.computed[i] :]]),
        positions=torch.cat([torch.arange(int(p), int(e)) for p, e in zip(prefix, ends)]),
        out_cache_loc=torch.cat([seqs.slots(i, p, e) for i, p, e in zip(rows, starts, stops)]),
        prefix_lens=prefix,
        extend_lens=ends - prefix,
        kv_slots=kv_slots,
        sampling=None,  # type: ignore[arg-type]  # forward_logits does not sample
    )
    for i in rows:
        seqs.computed[i] = len(seqs.tokens[i])
    all_tokens = torch.arange(int((ends - prefix).sum())) if all_rows else None
    return runner.forward_logits(batch, rows=all_tokens)


def generate(runner: ModelRunner, prompts: list[list[int]], new: int) -> list[list[int]]:
    seqs = Seqs([list(p) for p in prompts], [0] * len(prompts), max(map(len, prompts)) + new)
    rows = list(range(len(prompts)))
    for _ in range(new):
        for i, token in enumerate(forward(runner, seqs, rows).argmax(-1).tolist()):
            seqs.tokens[i].append(token)
    return [s[len(p) :] for s, p in zip(seqs.tokens, prompts)]


def teacher_forced(runner: ModelRunner, prompts: list[list[int]], outs: list[list[int]]):
    """Per sequence: log_softmax rows predicting each token of `outs` given what precedes it."""
    full = [p + o for p, o in zip(prompts, outs)]
    seqs = Seqs(full, [0] * len(full), max(map(len, full)))
    logits = forward(runner, seqs, list(range(len(full))), all_rows=True).log_softmax(-1)
    result, start = [], 0
    for p, o in zip(prompts, outs):
        result.append(logits[start + len(p) - 1 : start + len(p) + len(o) - 1])
        start += len(p) + len(o)
    return result


def accuracy(runners: dict[str, ModelRunner], prompts: list[list[int]], new: int) -> None:
    ref_name = "torch_native"
    outs = {name: generate(r, prompts, new) for name, r in runners.items()}
    ref_out = outs[ref_name]
    ref_lp = teacher_forced(runners[ref_name], prompts, ref_out)
    print(f"\nAccuracy against {ref_name} float32: {len(prompts)} prompts x {new} greedy tokens\n")
    print("| configuration | identical continuations | greedy agreement | mean abs Δ logprob |")
    print("|---|---|---|---|")
    for name, runner in runners.items():
        same = sum(a == b for a, b in zip(outs[name], ref_out))
        lp = teacher_forced(runner, prompts, ref_out)
        agree, total, delta = 0, 0, 0.0
        for mine, ref, tokens in zip(lp, ref_lp, ref_out):
            ids = torch.tensor(tokens)
            agree += int((mine.argmax(-1) == ids).sum())
            total += len(tokens)
            delta += float((mine.gather(1, ids[:, None]) - ref.gather(1, ids[:, None])).abs().sum())
        print(f"| {name} | {same}/{len(prompts)} | {agree / total:.4f} | {delta / total:.5f} |")


def speed(runners: dict[str, ModelRunner], args: argparse.Namespace, vocab: int) -> None:
    prompts = make_prompts(args.batch, 128, vocab)
    max_len = 128 + args.steps + 1
    pools = {n: Seqs([list(p) for p in prompts], [0] * len(prompts), max_len) for n in runners}
    solo = {n: Seqs([list(prompts[0])], [0], max_len) for n in runners}
    prefill: dict[str, float] = {}
    steps: dict[str, list[float]] = {n: [] for n in runners}
    solo_steps: dict[str, list[float]] = {n: [] for n in runners}
    rows = list(range(args.batch))
    for name, runner in runners.items():
        start = time.perf_counter()
        for chunk in range(0, args.batch, 16):  # 2048-token steps, as --chunked-prefill-size
            forward(runner, pools[name], rows[chunk : chunk + 16])
        prefill[name] = time.perf_counter() - start
        forward(runner, solo[name], [0])
    for _ in range(args.steps):
        for name, runner in runners.items():
            turns = ((pools[name], steps, rows), (solo[name], solo_steps, [0]))
            for seqs, times, batch_rows in turns:
                for i in batch_rows:
                    seqs.tokens[i].append(7)
                start = time.perf_counter()
                forward(runner, seqs, batch_rows)
                times[name].append(time.perf_counter() - start)
    print(f"\nSpeed: decode steps from context 128, median of {args.steps}, taking turns\n")
    b = args.batch
    print(
        f"| configuration | step, 1 seq (ms) | step, {b} seqs (ms) | {b} seqs tok/s "
        f"| prefill {b}x128 (s) |"
    )
    print("|---|---|---|---|---|")
    ref = statistics.median(steps["torch_native"])
    for name in runners:
        one, many = statistics.median(solo_steps[name]), statistics.median(steps[name])
        print(
            f"| {name} | {one * 1e3:.1f} | {many * 1e3:.0f} | {args.batch / many:.0f} "
            f"(x{ref / many:.2f}) | {prefill[name]:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    keep_freed_memory()  # as the server's model process does

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = max(args.batch * (128 + args.steps + 1), args.prompts * 256) + 1
    runners = {
        name: ModelRunner(
            path,
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_total_tokens=tokens,
            mem_fraction_static=0.0,
            tp=TPGroup(),
            seed=0,
            kernels=backend,
            quantization=quantization,
            fused_layers=fused,
        )
        for name, (backend, quantization, fused) in CONFIGS.items()
    }
    print(f"model {args.model}, float32 activations, torch threads {torch.get_num_threads()}")
    stream = weight_streaming_seconds(path)
    print(f"weight streaming (every weight byte read once, float32): {stream * 1e3:.1f} ms")
    with torch.inference_mode():
        if not args.skip_accuracy:
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": ask.format(topic)}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                for ask in ASKS
                for topic in TOPICS
            ][: args.prompts]
            prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
            accuracy(runners, prompts, args.new_tokens)
        speed(runners, args, len(tokenizer))


if __name__ == "__main__":
    main()
