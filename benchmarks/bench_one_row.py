"""A decode step of one sequence against the floor of reading its weights once, where the model
keeps them; in bfloat16 or float32, the extension's linear_panels for 1 to 4 rows on oneDNN's one
copy of the weights against oneDNN's matmul at every row count (what one copy ran before
linear_panels), the two taking turns on one model in this process; with --quantization int8 the
int8 kernels alone.

    python benchmarks/bench_one_row.py [--model PATH] [--dtype float32|bfloat16] [--steps 40]
                                       [--quantization int8]

float32 is the default dtype on CPUs without bfloat16; bfloat16 reads its panels with
AVX512-BF16's vdpbf16ps where there is no AMX (elsewhere it stays on oneDNN, and both
configurations are the same).
Both run cpu_extension with every decoder layer in one call (the default): the model's decoder
layers are fused twice over the same weights (`fuse_layers` with fused_ops.PANEL_ROWS and
BF16_PANEL_ROWS as served, then both 0) and the step swaps them, with both set to match for the
LM head; each configuration
decodes its own copy of the sequence in the pool. Prints the median step of each and the median
of their ratios; whether the greedy tokens agree (sums in another order can round a bfloat16
result the other way, and a near tie then the other way too); and each step against the
weight-streaming floor, timed in turn with the steps: every tensor a step reads (all the model
holds but the input embedding, of which a step reads one row) read once in place, as
weight_streaming.py's read_seconds reads a buffer (torch's float32 max over its bytes). The floor
reads the very pages the step reads: this machine's bandwidth differs from one buffer to another,
so a floor over other memory can be faster or slower than the model's.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts
from weight_streaming import read_seconds

from radixserve.model_worker import fused_ops
from radixserve.model_worker.layers import LoadableModule, VocabParallelEmbedding
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

# name: fused_ops.PANEL_ROWS and BF16_PANEL_ROWS while its fused layers are built and while it
# steps
PANELS = (fused_ops.PANEL_ROWS, fused_ops.BF16_PANEL_ROWS)
CONFIGS = {"linear_panels (as served)": PANELS, "oneDNN at every row count": (0, 0)}
INT8_CONFIGS = {"int8 kernels": PANELS}
PROMPT = 128


def step_weights(runner: ModelRunner) -> list[torch.Tensor]:
    """Every tensor a decode step reads in full, over the memory the model keeps it in: what each
    module holds but the input embedding (a oneDNN tensor as a view of its buffer)."""
    tensors = []
    for module in runner.model.modules():
        if isinstance(module, VocabParallelEmbedding) or not isinstance(module, LoadableModule):
            continue
        for tensor in module.held_tensors():
            if tensor.is_mkldnn:
                nbytes = int(torch.ops.mkldnn._nbytes(tensor))
                address = int(torch.ops.mkldnn.data_ptr(tensor))
                buffer = (ctypes.c_char * nbytes).from_address(address)
                tensor = torch.frombuffer(buffer, dtype=torch.uint8)
            tensors.append(tensor)
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quantization", choices=["int8"], default=None)
    args = parser.parse_args()
    configs = INT8_CONFIGS if args.quantization else CONFIGS
    keep_freed_memory()
    path = resolve_model_path(args.model)
    max_len = PROMPT + args.steps + 1
    dtype = getattr(torch, args.dtype)
    runner = ModelRunner(
        path,
        dtype=dtype,
        device=torch.device("cpu"),
        max_total_tokens=len(configs) * max_len + 8,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels="cpu_extension",
        quantization=args.quantization,
    )
    assert runner.fused_layers, "cpu_extension on one rank fuses the decoder layers"
    layers = runner.model.model
    fused = {}
    for name, panel_rows in configs.items():
        fused_ops.PANEL_ROWS, fused_ops.BF16_PANEL_ROWS = panel_rows
        layers.fuse_layers()
        fused[name] = layers.fused_layers
    prompt = make_prompts(1, PROMPT, runner.model_config.vocab_size)[0]
    seqs = Seqs([list(prompt) for _ in configs], [0] * len(configs), max_len)  # one a config
    weights = step_weights(runner)
    times: dict[str, list[float]] = {name: [] for name in configs}
    floors = []
    with torch.inference_mode():
        for _ in range(args.steps + 1):  # the first is the prompt's prefill, untimed
            floors.append(sum(read_seconds(w) for w in weights))
            for i, (name, panel_rows) in enumerate(configs.items()):
                fused_ops.PANEL_ROWS, fused_ops.BF16_PANEL_ROWS = panel_rows
                layers.fused_layers = fused[name]
                start = time.perf_counter()
                token = int(forward(runner, seqs, [i])[0].argmax())
                times[name].append(time.perf_counter() - start)
                seqs.tokens[i].append(token)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    floor = statistics.median(floors[1:])
    agree = ""
    if len(configs) == 2:
        a, b = seqs.tokens[0][PROMPT:], seqs.tokens[1][PROMPT:]
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        agree = "; greedy tokens " + (
            "identical" if same is None else f"first differ at decode step {same}"
        )
    print(
        f"{path}: {args.dtype}, quantization {args.quantization}, one sequence, {args.steps} "
        f"decode steps taking turns, threads {torch.get_num_threads()}{agree}"
    )
    for name, median in medians.items():
        print(f"  {name:28s} {median * 1e3:8.2f} ms per step, {median / floor:.2f}x the floor")
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(f"  {'weight-streaming floor':28s} {floor * 1e3:8.2f} ms ({gb:.2f} GB read once)")
    if len(configs) == 2:
        names = list(configs)
        ratios = [x / y for x, y in zip(times[names[0]][1:], times[names[1]][1:])]
        print(f"  ratio, median of pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
