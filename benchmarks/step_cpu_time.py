"""What a prefill chunk and a decode step of 64 cost in CPU time, on one thread: a figure that
other processes on a shared machine barely move (wall time at two threads they do), for A/Bs
taken while others work. Not the serving speed: on an idle machine use bench_vs_peers.py.

    python benchmarks/step_cpu_time.py [--model /work/models/qwen2-0.5b] [--dtype bfloat16]
                                       [--quantization int8 [--int8-layout plain]]
                                       [--disable-fused-layers]

Prefills 64 prompts of 128 tokens (two threads), then times on one thread, by the thread's CPU
time, the best of --repeats: a prefill of 16 of them afresh (2,048 tokens, the default
--chunked-prefill-size), a decode step of all 64 and one of a single sequence, each through the
LM head and the argmax. `--int8-layout plain` keeps int8 weights in the plain layout and kernels
of CPUs without AVX512-VNNI (int8_linear, oneDNN's int8_gemm), for an A/B on a CPU with it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts

from radixserve.model_worker import int8_weight
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

BATCH, PROMPT, CHUNK = 64, 128, 16


def thread_seconds(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/qwen2-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--int8-layout", default="auto", choices=("auto", "plain"))
    parser.add_argument("--disable-fused-layers", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    max_len = PROMPT + 2 * args.repeats + 3
    keep_freed_memory()
    if args.int8_layout == "plain":  # read as each weight is allocated, while the model loads
        int8_weight.vnni_layout_available = lambda: False
    runner = ModelRunner(
        resolve_model_path(args.model),
        dtype=getattr(torch, args.dtype),
        device=torch.device("cpu"),
        max_total_tokens=BATCH * max_len + 1,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels="cpu_extension",
        quantization=args.quantization,
        fused_layers=not args.disable_fused_layers,
    )
    prompts = make_prompts(BATCH, PROMPT, min(runner.model_config.vocab_size, 49152))
    seqs = Seqs([list(p) for p in prompts], [0] * BATCH, max_len)
    everyone, chunk = list(range(BATCH)), list(range(CHUNK))

    def prefill() -> None:
        for i in chunk:
            seqs.computed[i] = 0
        runner.sampler.argmax(forward(runner, seqs, chunk))

    def decode(rows: list[int]) -> None:
        for i in rows:
            seqs.tokens[i].append(7)
        runner.sampler.argmax(forward(runner, seqs, rows))

    with torch.inference_mode():
        for start in range(0, BATCH, CHUNK):
            forward(runner, seqs, list(range(start, start + CHUNK)))
        torch.set_num_threads(1)
        prefill_s = min(thread_seconds(prefill) for _ in range(args.repeats))
        decode_s = min(thread_seconds(lambda: decode(everyone)) for _ in range(args.repeats))
        one_s = min(thread_seconds(lambda: decode([0])) for _ in range(args.repeats))
    layout = ""
    if args.quantization == "int8":
        layout = f" ({args.int8_layout} layout)"
    print(
        f"{args.model}, {args.dtype}, quantization {args.quantization}{layout}, fused layers "
        f"{runner.fused_layers}; thread CPU time at 1 thread, best of {args.repeats}: "
        f"prefill of {CHUNK} x {PROMPT} {prefill_s * 1e3:.0f} ms, "
        f"decode step of {BATCH} {decode_s * 1e3:.0f} ms, of 1 {one_s * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
