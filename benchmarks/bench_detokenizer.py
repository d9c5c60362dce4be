"""The detokenizer's CPU time per decode step: the incremental detokenizer over N streams, each
step one new token each, decoding through transformers' batch_decode (the detokenizer before the
tokenizer handoff, and still for a slow tokenizer) and through the Rust tokenizer the tokenizer
manager hands it, taking turns in one process.

    python benchmarks/bench_detokenizer.py [--model DIR] [--streams 64] [--steps 128] [--rounds 3]

On a 2-core machine every millisecond the detokenizer spends a step is taken from the model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from transformers import AutoTokenizer

from radixserve.detokenizer.incremental import IncrementalDetokenizer
from radixserve.detokenizer.tokenizer_handoff import (
    Decoder,
    RustDecoder,
    TransformersDecoder,
    rust_tokenizer,
)
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.protocol.internal import ReqStart, ReqTokenOut


def cpu_ms_per_step(decoder: Decoder, streams: list[list[int]], context: int) -> float:
    detokenizer = IncrementalDetokenizer(decoder)
    spent = 0.0
    for step in range(context, len(streams[0])):
        outs = [
            ReqTokenOut(
                rid=f"r{i}",
                new_token_ids=[ids[step]],
                finished_reason=None,
                completion_tokens=step - context + 1,
                start=ReqStart(context, 0, True, [], ids[:context]) if step == context else None,
            )
            for i, ids in enumerate(streams)
        ]
        started = time.process_time()
        detokenizer.step(outs)
        spent += time.process_time() - started
    return spent / (len(streams[0]) - context) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    rust = rust_tokenizer(tokenizer)
    if rust is None:
        raise SystemExit("this tokenizer is decoded through transformers: nothing to compare")
    rng = random.Random(0)
    context = 4  # the prompt's last ids, as ReqStart.context carries them
    streams = [
        [rng.randrange(200, 40000) for _ in range(context + args.steps)]
        for _ in range(args.streams)
    ]
    decoders: dict[str, Decoder] = {
        "transformers' batch_decode": TransformersDecoder(tokenizer),
        "the handed-over Rust tokenizer": RustDecoder(rust),
    }
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for round_ in range(args.rounds):
        for name in list(decoders)[:: 1 if round_ % 2 == 0 else -1]:
            times[name].append(cpu_ms_per_step(decoders[name], streams, context))
    print(f"\n{args.streams} streams, {args.steps} steps of one token each, CPU ms per step\n")
    print("| decoder | ms per step (rounds) |")
    print("|---|---|")
    for name, ms in times.items():
        rounds = ", ".join(f"{m:.2f}" for m in ms)
        print(f"| {name} | {statistics.median(ms):.2f} ({rounds}) |")
    before, after = (statistics.median(ms) for ms in times.values())
    print(f"\nRust / transformers: {after / before:.2f}x")


if __name__ == "__main__":
    main()
