"""The tail of a decode step on a large vocabulary, in this process: the LM head and what follows
it until the next tokens, the pieces taking turns so that a shared machine's load falls on all.

    python benchmarks/bench_logits.py --model /work/models/qwen2-0.5b [--dtype bfloat16]
                                      [--batch 64 --repeats 7]

For --batch rows of random hidden states: the LM head as the model computes it (its matmul, the
logits in the model's dtype), the float32 conversion alone (what a step that samples adds; a
greedy step skips it), the greedy argmax with torch.argmax and with the model's ops' (the CPU
extension's kernel with cpu_extension) on the float32 logits, that kernel on the model-dtype logits
(what a greedy step runs), and the sampling path of temperature 0.8 / top_p 0.95 rows. Prints
each piece's median and its ratio to the head, and the ratio of the two argmaxes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixserve.model_worker.batch import SamplingBatchInfo
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.sampler import sample_tokens, torch_argmax
from radixserve.process_setup import keep_freed_memory


def sampling_info(rows: int, temperature: float, top_p: float) -> SamplingBatchInfo:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingBatchInfo(
        temperatures=full(temperature),
        top_ps=full(top_p),
        top_ks=full(-1, torch.int64),
        min_ps=full(0.0),
        repetition_penalties=full(1.0),
        frequency_penalties=full(0.0),
        presence_penalties=full(0.0),
        seeds=full(0, torch.int64),
        seeded=full(False, torch.bool),
        output_index=full(0, torch.int64),
        top_logprobs_nums=full(0, torch.int64),
        return_logprob=full(False, torch.bool),
        penalty_tokens=None,
        is_all_greedy=False,
        any_logprob=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--kernels", default="cpu_extension")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    runner = ModelRunner(
        resolve_model_path(args.model),
        dtype=dtype,
        device=torch.device("cpu"),
        max_total_tokens=16,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels=args.kernels,
    )
    model = runner.model
    hidden = torch.randn(args.batch, runner.model_config.hidden_size).to(dtype)
    native = model.compute_logits(hidden)
    logits = native.float()
    kernel_argmax = runner.sampler.argmax
    assert torch.equal(kernel_argmax(logits), torch_argmax(logits))
    info = sampling_info(args.batch, 0.8, 0.95)
    generator = torch.Generator().manual_seed(0)
    pieces: dict[str, Callable[[], object]] = {
        "LM head (matmul)": lambda: model.compute_logits(hidden),
        "float32 conversion alone": lambda: native.float(),
        "argmax, torch": lambda: torch_argmax(logits),
        "argmax, model's ops": lambda: kernel_argmax(logits),
        f"argmax, model's ops on {args.dtype}": lambda: kernel_argmax(native),
        "sample (T 0.8, top_p 0.95)": lambda: sample_tokens(logits, info, generator),
    }
    times: dict[str, list[float]] = {name: [] for name in pieces}
    with torch.inference_mode():
        for run in pieces.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in pieces.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    head = medians["LM head (matmul)"]
    print(
        f"{args.model}: vocab {runner.model_config.vocab_size}, {args.batch} rows, {args.dtype}, "
        f"{runner.kernels_name}, {args.repeats} interleaved repeats, threads "
        f"{torch.get_num_threads()}"
    )
    print(f"  {'piece':36s} {'median ms':>10s} {'/ LM head':>10s}")
    for name, median in medians.items():
        print(f"  {name:36s} {median * 1e3:10.2f} {median / head:10.2f}")
    ratios = [k / t for k, t in zip(times["argmax, model's ops"], times["argmax, torch"])]
    print(f"  argmax model's ops / torch, median of pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
