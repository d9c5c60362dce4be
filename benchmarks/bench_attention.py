"""The CPU extension's paged attention alone, on decode steps and prefill chunks: what a layer
costs with K and V in cache (the arithmetic) and from memory, against a baseline revision's
kernel in the same process, taking turns.

    python benchmarks/bench_attention.py [--dtype bfloat16] [--baseline HEAD] [--threads 1]
        [--shape 14/2x64 --shape 32/8x128] [--case 64x200+1 --case 16x0+128 ...]
        [--slots shuffled|in-a-row|served]

A shape is query heads / KV heads x head size (default: Qwen2-0.5B's and an 8B's); a case is
sequences x cached tokens + new tokens each (default: a decode step of 64 at context 200, one
sequence decoding at 2,000, and prefill chunks of 16 x 128 and 1 x 2,048). The slots are
shuffled by default (the worst case: the keys anywhere in the pool, in no order); with --slots
in-a-row each sequence's slots are in a row (a prompt prefilled into a fresh pool); with --slots
served they are as a fresh server's pool holds them after a burst of prompts, all prefilled
before the first decode: each sequence's first min(128, context) tokens (SERVED_PROMPT_TOKENS,
its prompt) in a row, then one slot a decode step for each later token and the new one, a
step's sequences in consecutive slots. Served takes decode cases only (+1); without --case it
runs the default decode cases. "From memory" cycles through enough layers' pools that a layer's
K and V are not in cache when it runs.

--baseline REV builds REV's attention.cpp (from `git archive`) once into the kernel cache, as
op namespace radixserve_baseline, and times it against the working tree's: both in one process,
alternating each round, medians of --rounds. Without it, the working tree's kernel alone.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Literal

import torch

from radixserve.model_worker import cpu_kernels

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("14/2x64", "32/8x128")
CASES = ("64x200+1", "1x2000+1", "16x0+128", "1x0+2048")
COLD_BYTES = 256e6  # K and V pools cycled through for "from memory": past any L3 here
SERVED_PROMPT_TOKENS = 128  # --slots served: a prompt's tokens (bench_vs_peers' prompts)
BASELINE_UNIT = """#include "{csrc}/attention.cpp"
#include <torch/library.h>
TORCH_LIBRARY(radixserve_baseline, m) {{
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor out_cache_loc, Tensor kv_slots, Tensor prefix_lens, Tensor extend_lens, "
        "float scale) -> Tensor");
}}
TORCH_LIBRARY_IMPL(radixserve_baseline, CPU, m) {{
  m.impl("paged_attention", &radixserve::paged_attention);
}}
"""


def load_baseline(rev: str) -> Callable[..., torch.Tensor]:
    """REV's paged_attention, built once per commit into the kernel cache. Its C++ namespace is
    renamed by a macro (-Dradixserve=...) so that both builds live in one process."""
    from torch.utils import cpp_extension

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    capability = cpu_kernels.build_key()["capability"]
    flags = [*cpu_kernels._cflags(capability), "-Dradixserve=radixserve_baseline_ns"]
    tag = hashlib.sha256(f"{commit} {flags}".encode()).hexdigest()[:12]
    build = cpu_kernels._cache_root() / f"baseline-attention-{tag}"
    library = build / "baseline.so"
    if not library.is_file():
        build.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit, "model_worker/csrc"],
            capture_output=True,
            check=True,
        ).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(build, filter="data")
        unit = build / "unit.cpp"
        unit.write_text(BASELINE_UNIT.format(csrc=build / "model_worker" / "csrc"))
        cpu_kernels._put_ninja_on_path()
        with tempfile.TemporaryDirectory(dir=build) as tmp:
            path = cpp_extension.load(
                name=f"radixserve_baseline_{tag}",
                sources=[str(unit)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=tmp,
                is_python_module=False,
            )
            Path(path).replace(library)
    torch.ops.load_library(str(library))
    return torch.ops.radixserve_baseline.paged_attention.default


def parse_shape(text: str) -> tuple[int, int, int]:
    heads, rest = text.split("/")
    kv_heads, head_dim = rest.split("x")
    return int(heads), int(kv_heads), int(head_dim)


def parse_case(text: str) -> tuple[int, int, int]:
    batch, rest = text.split("x")
    context, extend = rest.split("+")
    return int(batch), int(context), int(extend)


def make_layers(
    shape: tuple[int, int, int],
    case: tuple[int, int, int],
    dtype: torch.dtype,
    slots: Literal["shuffled", "in-a-row", "served"],
) -> tuple[list[tuple], float]:
    """Arguments of one call per layer (as many layers as "from memory" needs), and the FLOPs
    of a call (QK^T and PV, causal)."""
    heads, kv_heads, d = shape
    b, ctx, new = case
    gen = torch.Generator().manual_seed(0)
    num_slots = b * (ctx + new) + 1  # slot 0 is padding
    layer_bytes = num_slots * kv_heads * d * dtype.itemsize * 2
    num_layers = 1 if ctx == 0 else max(1, math.ceil(COLD_BYTES / layer_bytes))
    if slots == "served":
        assert new == 1, "--slots served lays out decode steps (one new token each)"
        kv_slots = served_slots(b, ctx)
    else:
        order = torch.arange(1, num_slots)
        if slots == "shuffled":
            order = order[torch.randperm(num_slots - 1, generator=gen)]
        kv_slots = order.view(b, ctx + new).contiguous()
    loc = kv_slots[:, ctx:].reshape(-1).contiguous()
    prefix = torch.full((b,), ctx, dtype=torch.int64)
    extend = torch.full((b,), new, dtype=torch.int64)
    q = torch.randn(b * new, heads, d, generator=gen).to(dtype)
    k = torch.randn(b * new, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(b * new, kv_heads, d, generator=gen).to(dtype)
    layers = []
    for _ in range(num_layers):
        k_pool = torch.randn(num_slots, kv_heads, d, generator=gen).to(dtype)
        v_pool = torch.randn(num_slots, kv_heads, d, generator=gen).to(dtype)
        layers.append((q, k, v, k_pool, v_pool, loc, kv_slots, prefix, extend, d**-0.5))
    keys = b * sum(ctx + i + 1 for i in range(new))  # (query token, key) pairs, causal
    return layers, 4.0 * keys * heads * d


def served_slots(b: int, ctx: int) -> torch.Tensor:
    """[b, ctx + 1] slots from 1 on: each sequence's first min(SERVED_PROMPT_TOKENS, ctx)
    slots in a row, prompt after prompt, then one slot a step for its later tokens and the new
    one, the b sequences' slots of a step side by side."""
    prompt_len = min(SERVED_PROMPT_TOKENS, ctx)
    steps = ctx + 1 - prompt_len
    prompts = torch.arange(1, 1 + b * prompt_len).view(b, prompt_len)
    decoded = 1 + b * prompt_len + torch.arange(b * steps).view(steps, b).T
    return torch.cat([prompts, decoded], dim=1)


def seconds_per_call(op: Callable[..., torch.Tensor], layers: list[tuple], hot: bool) -> float:
    """One timing: every layer once (from memory), or the first as many times (in cache), for
    at least 50 ms. On one thread the process's CPU time, which a neighbour taking turns on the
    core does not count into it; on more, wall time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    calls = [layers[0]] * len(layers) if hot else layers
    reps, elapsed = 0, 0.0
    start = clock()
    while elapsed < 0.05:
        for args in calls:
            op(*args)
        reps += 1
        elapsed = clock() - start
    return elapsed / (reps * len(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--shape", action="append", help="heads/kv_heads x head_dim")
    parser.add_argument("--case", action="append", help="sequences x context + new tokens")
    parser.add_argument(
        "--slots",
        default="shuffled",
        choices=("shuffled", "in-a-row", "served"),
        help="shuffled: keys in no order; in-a-row: each sequence's in a row; served: "
        "prompts in a row, then a step's sequences side by side (decode cases only)",
    )
    parser.add_argument("--baseline", default=None, help="git revision to time against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cases = args.case or CASES
    if args.slots == "served":
        if args.case is None:
            cases = [c for c in CASES if parse_case(c)[2] == 1]
        elif any(parse_case(c)[2] != 1 for c in cases):
            parser.error("--slots served lays out decode steps: every --case needs +1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    clock = "CPU time" if args.threads == 1 else "wall time"
    cpu_kernels.load_cpu_kernels()
    ops = {"ours": torch.ops.radixserve.paged_attention.default}
    if args.baseline:
        ops = {"baseline": load_baseline(args.baseline), **ops}
    print(
        f"paged_attention, {args.dtype}, threads {args.threads} ({clock}), median of "
        f"{args.rounds} rounds taking turns; slots {args.slots}; baseline {args.baseline or '-'}\n"
    )
    names = list(ops)
    header = " | ".join(f"{n} ms (GFLOP/s)" for n in names)
    ratio = " | ours / baseline" if args.baseline else ""
    print(f"| shape | case | K/V | {header}{ratio} |")
    print("|---|---|---|" + "---|" * len(names) + ("---|" if args.baseline else ""))
    for shape_text in args.shape or SHAPES:
        for case_text in cases:
            shape, case = parse_shape(shape_text), parse_case(case_text)
            layers, flops = make_layers(shape, case, dtype, args.slots)
            outs = [ops[n](*layers[0]) for n in names]
            if len(outs) == 2:  # another revision sums in another order: close, not equal
                torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
            modes = ("in cache",) if len(layers) == 1 else ("in cache", "from memory")
            for mode in modes:
                times: dict[str, list[float]] = {n: [] for n in names}
                for r in range(args.rounds):
                    for n in names if r % 2 == 0 else reversed(names):
                        times[n].append(seconds_per_call(ops[n], layers, mode == "in cache"))
                med = {n: statistics.median(times[n]) for n in names}
                cells = " | ".join(
                    f"{med[n] * 1e3:.3f} ({flops / med[n] / 1e9:.0f})" for n in names
                )
                tail = f" | {med['ours'] / med['baseline']:.2f}x" if args.baseline else ""
                print(f"| {shape_text} | {case_text} | {mode} | {cells}{tail} |", flush=True)


if __name__ == "__main__":
    main()
