"""Where a step goes: torch.profiler over decode steps (greedy: the forward, the LM head and the
argmax), at 1 and at --batch sequences, and over prefills of --prefill-batch prompts, of any
model (--model), in this process.

    python benchmarks/profile_step.py [--model /work/models/qwen2-0.5b] [--dtype bfloat16]
                                      [--batch 64 --prefill-batch 16 --steps 5]
                                      [--kernels cpu_extension] [--quantization int8]
                                      [--disable-fused-layers] [--device cuda]

Prints the wall time of a step, the op categories' self CPU time (matmuls, attention and its KV
gather, the small ops; on a GPU the CUDA runtime's launches and syncs), what the ops leave
unaccounted (Python and dispatch between ops), and the top ops. With cpu_extension the decoder
layers run in one call of the extension, which calls its kernels without the dispatcher: the
profiler then sees only the ops around them and the aten ops inside, so the categories say where a
step goes only with --disable-fused-layers; the step time is right either way, and so is the time
without the profiler, printed first. On a GPU (`--device cuda`, `--kernels auto`) it also prints
how long the GPU was busy per step and with how many kernels: a step much longer than that is
bound by the host (Python, launches, syncs).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts
from torch.autograd import DeviceType

from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

CATEGORIES = {
    "matmul": (
        "aten::addmm",
        "aten::mm",
        "radixserve::linear_small_m",
        "radixserve::linear_panels",
        "mkldnn::_linear_pointwise",
        "quantized::linear",
        "radixserve::int8_linear",
        "radixserve::int8_gemm",
        "radixserve::int8_vnni_linear",
        "radixserve::linear_panels",
        "radixserve::quantize_rows_int8",
        "radixserve::dequantize_rows",
        "aten::_int_mm",
    ),
    "attention": ("aten::_scaled_dot_product", "radixserve::paged_attention", "aten::bmm"),
    "KV gather and write": ("aten::index_select", "aten::index_put_", "aten::index"),
    "CUDA runtime": ("cuda", "cuLaunch"),  # launches and syncs, on the host
}


def category(op: str) -> str:
    for name, prefixes in CATEGORIES.items():
        if op.startswith(prefixes):
            return name
    return "small ops"


def decode(runner: ModelRunner, seqs: Seqs, rows: list[int]) -> None:
    """One greedy decode step of `rows`: a token each, through the forward and the argmax."""
    for i in rows:
        seqs.tokens[i].append(7)
    runner.sampler.argmax(forward(runner, seqs, rows))


def prefill(runner: ModelRunner, seqs: Seqs, rows: list[int]) -> None:
    """The prompts of `rows` computed afresh (their KV rewritten in place), and the argmax."""
    for i in rows:
        seqs.computed[i] = 0
    runner.sampler.argmax(forward(runner, seqs, rows))


Step = Callable[[ModelRunner, Seqs, list[int]], None]


def wait_for_gpu(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Step, runner: ModelRunner, seqs: Seqs, rows: list[int], steps: int) -> float:
    """Seconds per step of `rows`, over `steps` steps (on a GPU, until its kernels are done)."""
    wait_for_gpu(runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        step(runner, seqs, rows)
    wait_for_gpu(runner.device)
    return (time.perf_counter() - start) / steps


def profile(step: Step, runner: ModelRunner, seqs: Seqs, rows: list[int], steps: int) -> None:
    timed_steps(step, runner, seqs, rows, 1)  # warm-up
    unprofiled = timed_steps(step, runner, seqs, rows, steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = timed_steps(step, runner, seqs, rows, steps)
    totals: dict[str, float] = defaultdict(float)
    averages = prof.key_averages()
    ops = [e for e in averages if e.self_cpu_time_total > 0]
    for e in ops:
        totals[category(e.key)] += e.self_cpu_time_total / steps / 1e3
    print(
        f"\n{step.__name__} of {len(rows)} sequence(s): step {unprofiled * 1e3:.1f} ms, "
        f"{wall * 1e3:.1f} ms under the profiler"
    )
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:22s} {ms:8.1f} ms")
    print(f"  {'not in ops (Python…)':22s} {wall * 1e3 - sum(totals.values()):8.1f} ms")
    if runner.device.type == "cuda":
        # The GPU's own events only (kernels, copies): an op's self device time counts its
        # kernels again, and so does a user annotation's.
        on_gpu = [
            e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        ]
        busy = sum(e.self_device_time_total for e in on_gpu) / steps / 1e3
        launched = sum(e.count for e in on_gpu) / steps
        print(f"  GPU busy {busy:.1f} ms per step, {launched:.0f} kernels and copies")
    calls = sum(e.count for e in ops) / steps
    print(f"  ops per step: {calls:.0f}; top:")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"    {e.key:40s} {e.self_cpu_time_total / steps / 1e3:7.2f} ms  x{e.count // steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--kernels", default="cpu_extension")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--disable-fused-layers", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    # Each profile adds 2 * steps + 1 tokens to its sequences, and sequence 0 is in both.
    max_len = 128 + 4 * (args.steps + 1)
    keep_freed_memory()
    runner = ModelRunner(
        resolve_model_path(args.model),
        dtype=getattr(torch, args.dtype),
        device=torch.device(args.device),
        max_total_tokens=args.batch * max_len + 1,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels=args.kernels,
        quantization=args.quantization,
        fused_layers=not args.disable_fused_layers,
    )
    print(
        f"{runner.kernels_name}, {args.dtype}, quantization {args.quantization}, "
        f"fused layers {runner.fused_layers}, threads {torch.get_num_threads()}"
    )
    prompts = make_prompts(args.batch, 128, min(runner.model_config.vocab_size, 49152))
    seqs = Seqs([list(p) for p in prompts], [0] * args.batch, max_len)
    with torch.inference_mode():
        for chunk in range(0, args.batch, 16):
            forward(runner, seqs, list(range(chunk, min(chunk + 16, args.batch))))
        profile(prefill, runner, seqs, list(range(min(args.prefill_batch, args.batch))), args.steps)
        profile(decode, runner, seqs, [0], args.steps)
        profile(decode, runner, seqs, list(range(args.batch)), args.steps)


if __name__ == "__main__":
    main()
