"""TP=2 (two processes, gloo on CPU) gives what TP=1 gives: each parallel layer the unsharded
layer's output, and whole tiny random models the same logits."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_sampler import make_info

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.fused_ops import TorchOps
from radixserve.model_worker.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.weight_format import WeightFormat

TP = 2
TOLERANCE = 1e-4
LAYER_TOLERANCE = 1e-5


def make_batch(lens: list[tuple[int, int]], slots: torch.Tensor) -> ModelWorkerBatch:
    """Sequence i owns slots[i::len(lens)]; its token ids spread over both vocabulary shards."""
    prefix = torch.tensor([p for p, _ in lens])
    extend = torch.tensor([e for _, e in lens])
    seq_lens = prefix + extend
    kv_slots = torch.zeros(len(lens), int(seq_lens.max()), dtype=torch.int64)
    for i, n in enumerate(seq_lens.tolist()):
        kv_slots[i, :n] = slots[i :: len(lens)][:n]
    positions = torch.cat([torch.arange(p, p + e) for p, e in lens])
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), extend)
    return ModelWorkerBatch(
        input_ids=(97 * seq_of_token + 31 * positions + 3) % 200,
        positions=positions,
        out_cache_loc=kv_slots[seq_of_token, positions],
        prefix_lens=prefix,
        extend_lens=extend,
        kv_slots=kv_slots,
        sampling=make_info(0),
    )


def run_steps(path: Path, tp: TPGroup) -> list[torch.Tensor]:
    runner = ModelRunner(
        str(path),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=64,
        mem_fraction_static=0.0,
        tp=tp,
        seed=0,
    )
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0)) + 1
    steps = [[(0, 7), (0, 5)], [(7, 1), (5, 3)], [(8, 1), (8, 1)]]
    out = []
    for lens in steps:
        batch = make_batch(lens, slots)
        out.append(runner.forward_logits(batch, rows=torch.arange(batch.input_ids.numel())))
    return out


def layer_errors(tp: TPGroup) -> dict[str, float]:
    """Max |sharded - unsharded| of each parallel layer on this rank, for random weights that
    every rank draws alike. The q/k/v projection has 4 query heads and 1 KV head: each rank
    holds 2 query heads and a replica of the KV head."""
    gen = torch.Generator().manual_seed(1)
    ops, f32, cpu = TorchOps(), torch.float32, torch.device("cpu")
    PLAIN = WeightFormat.PLAIN
    x = torch.randn(5, 32, generator=gen)
    errors = {}

    head_dim, q_heads, kv_heads = 8, 4, 1
    pieces = [torch.randn(n * head_dim, 32, generator=gen) for n in (q_heads, kv_heads, kv_heads)]
    q_head, num_q = tp.shard(q_heads, "q heads")
    kv_head, num_kv = tp.shard_heads(kv_heads, "kv heads")
    shards = [(q_head * head_dim, num_q * head_dim), *[(kv_head * head_dim, num_kv * head_dim)] * 2]
    qkv = ColumnParallelLinear(
        32,
        [p.shape[0] for p in pieces],
        bias=False,
        tp=tp,
        ops=ops,
        weight_format=PLAIN,
        dtype=f32,
        device=cpu,
        shards=shards,
    )
    for piece, w in enumerate(pieces):
        qkv.load_weight("weight", w, piece)
    expected = torch.cat([(x @ w.T)[:, s : s + n] for w, (s, n) in zip(pieces, shards)], dim=-1)
    errors["qkv with replicated KV heads"] = (qkv(x) - expected).abs().max().item()

    w, b = torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    row = RowParallelLinear(
        32, 24, bias=True, tp=tp, ops=ops, weight_format=PLAIN, dtype=f32, device=cpu
    )
    row.load_weight("weight", w)
    row.load_weight("bias", b)
    start, n = tp.shard(32, "input")
    errors["row parallel"] = (row(x[:, start : start + n]) - (x @ w.T + b)).abs().max().item()

    table = torch.randn(255, 32, generator=gen)  # 255 rows: the last rank's shard is padded
    embed = VocabParallelEmbedding(255, 32, tp=tp, dtype=f32, device=cpu)
    embed.load_weight("weight", table)
    head = ParallelLMHead(255, 32, tp=tp, ops=ops, weight_format=PLAIN, dtype=f32, device=cpu)
    head.load_weight("weight", table)
    ids = torch.tensor([0, 127, 128, 254, 3])
    errors["vocab embedding"] = (embed(ids) - table[ids]).abs().max().item()
    errors["vocab logits"] = (head.compute_logits(x) - x @ table.T).abs().max().item()
    return errors


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        torch.save(layer_errors(TPGroup(rank=rank, size=TP)), out_dir / f"layers-rank{rank}.pt")
        for i, path in enumerate(paths):
            logits = run_steps(path, TPGroup(rank=rank, size=TP))
            torch.save(logits, out_dir / f"model{i}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_logits_equal_tp1(tiny_model, tmp_path: Path) -> None:
    paths = [
        tiny_model("qwen3", tie_word_embeddings=True),
        # 255 rows do not split evenly: the last rank's vocabulary shard is padded.
        tiny_model("llama", tie_word_embeddings=False, vocab_size=255, attention_bias=True),
        # One KV head for two ranks: each holds a replica of it (and of its biases).
        tiny_model("qwen2", num_key_value_heads=1),
    ]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=TP, join=True)
    for rank in range(TP):
        errors = torch.load(tmp_path / f"layers-rank{rank}.pt")
        assert len(errors) == 4
        for layer, error in errors.items():
            assert error < LAYER_TOLERANCE, (rank, layer, error)
    for i, path in enumerate(paths):
        expected = run_steps(path, TPGroup())
        for rank in range(TP):
            got = torch.load(tmp_path / f"model{i}-rank{rank}.pt")
            for ours, ref in zip(got, expected, strict=True):
                assert ours.shape == ref.shape
                assert (ours - ref).abs().max().item() < TOLERANCE
