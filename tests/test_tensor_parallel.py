"""TP=2 (two processes, gloo on CPU) gives the logits TP=1 gives, on tiny random models."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_sampler import make_info

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup

TP = 2
TOLERANCE = 1e-4


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


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
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
    ]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=TP, join=True)
    for i, path in enumerate(paths):
        expected = run_steps(path, TPGroup())
        for rank in range(TP):
            got = torch.load(tmp_path / f"model{i}-rank{rank}.pt")
            for ours, ref in zip(got, expected, strict=True):
                assert ours.shape == ref.shape
                assert (ours - ref).abs().max().item() < TOLERANCE
