"""Why bfloat16 greedy outputs can differ with speculation on and off: a diagnosis, no fix.

    python benchmarks/bf16_row_invariance.py [--model SmolLM2-135M-Instruct]

1. Per linear layer of the model (oneDNN on the packed weight, as cpu_extension runs it): the call
   sizes M whose rows are not bit for bit what each row gives alone. Each row's result depends
   on M only, never on the other rows' values; on the 2-core EPYC (avx512_core_bf16, 2026-11-25)
   only layers with an input wider than 1024 (down_proj, 1536) depend on it: M <= 6 sums the
   products in one order, M >= 7 (up to 2048 at least) in another, and a few outputs in 10^4
   that sit near a bf16 rounding midpoint round the other way.
2. The target's logits of the same positions decoded one row at a time and verified as one
   extend of 7 rows (the modules op by op): different, and the same bit for bit once every
   matmul of fewer than 8 rows on such a layer is computed as 8 rows (zero padding). Attention
   (cpu_extension, decode against extend) adds no difference.
3. What that padding would cost: down_proj at 1 and at 8 rows, the best of many calls. Measure it
   on an idle machine before changing any kernel (packed_linear.py and the fused layers'
   onednn_linear in csrc/decoder.cpp would both pad).
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.model_worker import packed_linear
from radixserve.model_worker.batch import ModelWorkerBatch, SamplingBatchInfo
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.packed_linear import PackedWeight
from radixserve.model_worker.parallel import TPGroup

PAD_ROWS = 8  # the fewest rows that take the many-row summation order here
WIDE = 1024  # inputs wider than this are summed in an M-dependent order


def rows_that_depend_on_m(n: int, k: int, max_rows: int = 16) -> list[int]:
    """The call sizes M (up to max_rows) whose rows differ from the rows computed alone."""
    gen = torch.Generator().manual_seed(0)
    weight = PackedWeight((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
    x = torch.randn(64, k, generator=gen).bfloat16()
    alone = torch.cat([weight.matmul(x[i : i + 1], None) for i in range(64)])
    many = weight.matmul(x, None)  # 64 rows: the many-row order
    return [
        m
        for m in range(1, max_rows + 1)
        if not torch.equal(weight.matmul(x[:m], None), alone[:m])
        or not torch.equal(weight.matmul(x[:m], None), many[:m])
    ]


def padded_matmul(self: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    if m >= PAD_ROWS or k <= WIDE:
        return UNPADDED(self, x, bias)
    return UNPADDED(self, torch.cat([x, x.new_zeros(PAD_ROWS - m, k)]), bias)[:m]


UNPADDED = PackedWeight.matmul


def decode_against_extend(runner: ModelRunner, prompt: int = 300, k: int = 7) -> float:
    """Largest logit difference between k positions decoded one at a time and verified as one
    extend of k rows, over the same KV prefix."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, runner.model_config.vocab_size, (prompt + k,), generator=gen)
    slots = torch.arange(1, prompt + k + 1)

    def run(start: int, n: int) -> torch.Tensor:
        batch = ModelWorkerBatch(
            input_ids=tokens[start : start + n],
            positions=torch.arange(start, start + n),
            out_cache_loc=slots[start : start + n],
            prefix_lens=torch.tensor([start]),
            extend_lens=torch.tensor([n]),
            kv_slots=slots[None, : start + n],
            sampling=_no_sampling(),
        )
        return runner.forward_logits(batch, torch.arange(n))

    run(0, prompt)
    extend = run(prompt, k)
    decoded = torch.cat([run(prompt + i, 1) for i in range(k)])
    return float((extend - decoded).abs().max())


def _no_sampling() -> SamplingBatchInfo:
    one = torch.ones(1)
    zero = torch.zeros(1, dtype=torch.int64)
    return SamplingBatchInfo(
        temperatures=one, top_ps=one, top_ks=zero - 1, min_ps=one * 0,
        repetition_penalties=one, frequency_penalties=one * 0, presence_penalties=one * 0,
        seeds=zero, seeded=zero.bool(), output_index=zero, top_logprobs_nums=zero,
        return_logprob=zero.bool(), penalty_tokens=None, is_all_greedy=True, any_logprob=False,
    )  # fmt: skip


def best_time(weight: PackedWeight, rows: int, calls: int = 200, rounds: int = 20) -> float:
    x = torch.randn(rows, weight.shape[1]).bfloat16()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            weight.matmul(x, None)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    runner = ModelRunner(
        resolve_model_path(args.model),
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        max_total_tokens=4096,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        fused_layers=False,
    )
    c = runner.model_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {
        "qkv_proj": (q + 2 * kv, c.hidden_size),
        "o_proj": (c.hidden_size, q),
        "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }
    print("1. call sizes M <= 16 whose rows differ from the rows alone (bf16, oneDNN):")
    for name, (n, k) in shapes.items():
        print(f"   {name} ({k} -> {n}): {rows_that_depend_on_m(n, k) or 'none'}")
    print("2. logits, decoded one row at a time against one 7-row extend (max |diff|):")
    print(f"   as is: {decode_against_extend(runner)}")
    packed_linear.PackedWeight.matmul = padded_matmul  # type: ignore[method-assign]
    print(f"   matmuls under {PAD_ROWS} rows of inputs wider than {WIDE} padded: "
          f"{decode_against_extend(runner)}")  # fmt: skip
    packed_linear.PackedWeight.matmul = UNPADDED  # type: ignore[method-assign]
    down = PackedWeight(torch.randn(c.hidden_size, c.intermediate_size).bfloat16())
    one, eight = best_time(down, 1), best_time(down, PAD_ROWS)
    print(f"3. down_proj, best of many calls: 1 row {one * 1e6:.0f} us, {PAD_ROWS} rows "
          f"{eight * 1e6:.0f} us ({eight / one:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
