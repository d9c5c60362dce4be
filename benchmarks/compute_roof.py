"""The most output tokens per second this CPU's arithmetic allows a workload of many requests at
once, for any engine: the multiply-adds it needs, at the peak rate of the instruction its
matmuls run on, on every core.

    python benchmarks/compute_roof.py [--model /work/models/qwen2-0.5b]
                                      [--num-requests 64 --input-len 128 --output-len 128]
                                      [--measured "radixserve int8=353.6,vLLM bf16=190.2"]

Counts each request's multiply-adds: its prompt through every decoder layer's linears and
attention, the LM head on its last prompt token only, then output_len - 1 decode tokens through
all of it (the first output token comes with the prompt). Times, on one core, a loop of
independent instructions on registers (no memory): vdpbf16ps (bfloat16 pairs, where the CPU has
AVX512-BF16), vpdpbusd (int8 quads, with AVX512-VNNI) and vfmadd231ps (float32, on zmm with
AVX-512, else on ymm with AVX2), compiled here with $CC, and multiplies by the cores this
process may use. The attention's multiply-adds are counted at the matmuls' rate, which they
never reach: the roof is an upper bound, as it should be. With AMX the matmuls run on tiles that
this does not time: it says so, and the roof is not this CPU's.

`--measured` takes "name dtype=tok/s" pairs (dtype bf16, int8 or fp32) and prints each as a share
of its dtype's roof; a ratio asked against a peer (e.g. 1.5x vLLM) is possible only where that
multiple of the peer's figure stays under the roof.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

from radixserve.model_worker.cpu_features import cpu_flags
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.model_source import resolve_model_path

_ROUNDS = 20_000_000
_ACCUMULATORS = 24  # independent chains, more than latency x throughput on any of these cores

Loop = tuple[str, str, list[str], set[str], int]

# dtype -> its loop on the widest registers the CPU has, in order of preference: (instruction,
# registers, compiler flags, CPU flags needed, multiply-adds per instruction)
_LOOPS: dict[str, list[Loop]] = {
    "bf16": [("vdpbf16ps", "zmm", ["-mavx512f", "-mavx512bf16"], {"avx512_bf16"}, 32)],
    "int8": [("vpdpbusd", "zmm", ["-mavx512f", "-mavx512vnni"], {"avx512_vnni"}, 64)],
    "fp32": [
        ("vfmadd231ps", "zmm", ["-mavx512f"], {"avx512f"}, 16),
        ("vfmadd231ps", "ymm", ["-mavx2", "-mfma"], {"avx2", "fma"}, 8),
    ],
}


def _loop_source(instruction: str, registers: str) -> tuple[str, int]:
    """The loop's C source, and its chains (ymm0-15 only without AVX-512: 12 there, 24 on zmm)."""
    chains = _ACCUMULATORS if registers == "zmm" else 12
    a, b = (30, 31) if registers == "zmm" else (14, 15)
    body = "".join(
        f'"{instruction} %%{registers}{a}, %%{registers}{b}, %%{registers}{i}\\n"'
        for i in range(chains)
    )
    clobbers = ", ".join(f'"xmm{i}"' for i in (*range(chains), a, b))
    return (
        "#include <stdint.h>\n"
        "void peak_loop(int64_t n) {\n"
        f'  __asm__ volatile("1:\\n" {body} "dec %0\\n" "jnz 1b\\n"\n'
        f'                   : "+r"(n) : : {clobbers}, "cc");\n'
        "}\n"
    ), chains


def loop_for(kind: str) -> Loop | None:
    """The loop that times `kind` here; None where the CPU has no instruction for it."""
    return next((loop for loop in _LOOPS[kind] if loop[3] <= cpu_flags()), None)


def core_peak_macs(kind: str) -> float | None:
    """One core's multiply-adds per second in the loop of `kind`'s instruction; None where the
    CPU lacks it."""
    loop = loop_for(kind)
    if loop is None:
        return None
    instruction, registers, flags, _, per_instruction = loop
    source_text, chains = _loop_source(instruction, registers)
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp, "peak.c"), Path(tmp, "peak.so")
        source.write_text(source_text)
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, "-O2", *flags, "-shared", "-fPIC", source, "-o", library], check=True
        )
        peak_loop = ctypes.CDLL(str(library)).peak_loop
        peak_loop.argtypes = [ctypes.c_int64]
        best = float("inf")
        for _ in range(3):
            start = time.thread_time()
            peak_loop(_ROUNDS)
            best = min(best, time.thread_time() - start)
    return _ROUNDS * chains * per_instruction / best


def request_macs(config: ModelConfig, input_len: int, output_len: int) -> tuple[float, float]:
    """One request's multiply-adds: its prompt's (to its first output token), and all of it."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
    linears = config.num_hidden_layers * per_layer
    lm_head = config.vocab_size * hidden

    def attention(positions: range) -> float:
        # A token at position p attends to p + 1 keys: its scores and its weighted sum of the
        # values take q multiply-adds a key each.
        return config.num_hidden_layers * 2 * q * sum(p + 1 for p in positions)

    prompt = input_len * linears + lm_head + attention(range(input_len))
    decode = (output_len - 1) * (linears + lm_head)  # the first output came with the prompt
    return prompt, prompt + decode + attention(range(input_len, input_len + output_len - 1))


def parse_measured(text: str) -> list[tuple[str, str, float]]:
    """ "name dtype=tok/s, ..." -> [(name, dtype, tok/s)]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.rpartition("=")
        label, _, kind = name.strip().rpartition(" ")
        try:
            figure = float(value)
        except ValueError:
            figure = -1.0
        if not label or kind not in _LOOPS or figure <= 0:
            raise SystemExit(
                f"--measured: {item!r} is not 'name dtype=tok/s' (dtype one of "
                f"{', '.join(_LOOPS)}, tok/s a positive number)"
            )
        out.append((label, kind, figure))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/qwen2-0.5b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--measured", default="", help='"name dtype=tok/s, ..." to compare')
    args = parser.parse_args()
    measured = parse_measured(args.measured)
    config = ModelConfig.from_dir(resolve_model_path(args.model))
    cores = len(os.sched_getaffinity(0))
    prompt_macs, one = request_macs(config, args.input_len, args.output_len)
    macs = args.num_requests * one
    # Whatever the order, the median first token waits for half the prompts (the two middle
    # ones' mean, for an even count).
    ttft_macs = (args.num_requests + 1) / 2 * prompt_macs
    outputs = args.num_requests * args.output_len
    print(
        f"{args.model}: {args.num_requests} requests x {args.input_len}/{args.output_len}, "
        f"{macs / 1e12:.2f} T multiply-adds for {outputs} output tokens; {cores} core(s)"
    )
    if {"amx_bf16", "amx_int8"} & cpu_flags():
        print(
            "this CPU has AMX: its matmuls run on tiles, faster than the loops below, "
            "so the roofs below are not this CPU's"
        )
    print()
    print(
        "| dtype | instruction | one core (G multiply-adds/s) | all cores | floor (s) "
        "| roof (tok/s) | TTFT p50 floor (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    roofs: dict[str, float] = {}
    for kind, loops in _LOOPS.items():
        loop, peak = loop_for(kind), core_peak_macs(kind)
        if loop is None or peak is None:
            print(f"| {kind} | {loops[0][0]} | not on this CPU | | | | |")
            continue
        instruction = f"{loop[0]} ({loop[1]})"
        floor = macs / (peak * cores)
        roofs[kind] = outputs / floor
        print(
            f"| {kind} | {instruction} | {peak / 1e9:.0f} | {peak * cores / 1e9:.0f} | "
            f"{floor:.2f} | {roofs[kind]:.0f} | {ttft_macs / (peak * cores):.2f} |"
        )
    for label, kind, value in measured:
        roof = roofs.get(kind)
        if roof is None:
            print(f"- {label}: no {kind} roof on this CPU")
            continue
        print(
            f"- {label} ({kind}): {value:.1f} tok/s = {value / roof:.0%} of the roof; "
            f"the roof is {roof / value:.2f}x it"
        )


if __name__ == "__main__":
    main()
