"""The torch attention backend against a naive per-sequence float64 reference."""

from __future__ import annotations

import pytest
import torch
from test_sampler import make_info

from radixserve.model_worker.attention import create_attention_backend
from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.kv_pool import TokenToKVPool

HEAD_DIM = 8
NUM_SLOTS = 400


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q [n, H, D] of positions prefix..prefix+n-1; k, v [prefix + n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / HEAD_DIM**0.5
    query_pos = torch.arange(q.shape[0])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "lens"),
    [
        (4, 2, [(5, 1), (0, 7), (12, 1), (3, 4), (0, 1), (9, 2)]),  # mixed, unsorted
        (4, 4, [(0, 6), (2, 3)]),  # extends only, MHA
        (6, 1, [(7, 1), (0, 1), (20, 1)]),  # decodes only, MQA
        (4, 2, [(0, 9)]),  # one prefill
        (4, 2, [(6, 4)]),  # one chunk over a cached prefix
        (4, 2, [(5, 1)]),  # one decode
        (8, 2, [(4, 5), (9, 1)]),  # one of each
    ],
)
def test_matches_reference(
    device: torch.device, num_heads: int, num_kv_heads: int, lens: list[tuple[int, int]]
) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = TokenToKVPool(NUM_SLOTS, 1, num_kv_heads, HEAD_DIM, dtype=torch.float32, device=device)
    # Padding reads slot 0: make it loud, so that a mask letting it through fails the test.
    pool.k_buffers[0][0] = 1e4
    pool.v_buffers[0][0] = 1e4
    free = (torch.randperm(NUM_SLOTS - 1, generator=gen) + 1).tolist()
    prefix = torch.tensor([p for p, _ in lens])
    extend = torch.tensor([e for _, e in lens])
    seq_lens = prefix + extend
    kv_slots = torch.zeros(len(lens), int(seq_lens.max()), dtype=torch.int64)
    cached_k, cached_v = [], []
    for i, (p, e) in enumerate(lens):
        kv_slots[i, : p + e] = torch.tensor([free.pop() for _ in range(p + e)])
        cached_k.append(torch.randn(p, num_kv_heads, HEAD_DIM, generator=gen))
        cached_v.append(torch.randn(p, num_kv_heads, HEAD_DIM, generator=gen))
        pool.set_kv(0, kv_slots[i, :p].to(device), cached_k[-1].to(device), cached_v[-1].to(device))
    out_cache_loc = torch.cat([kv_slots[i, p : p + e] for i, (p, e) in enumerate(lens)])
    num_tokens = int(extend.sum())
    batch = ModelWorkerBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in lens]),
        out_cache_loc=out_cache_loc,
        prefix_lens=prefix,
        extend_lens=extend,
        kv_slots=kv_slots,
        sampling=make_info(0),
    )
    fb = ForwardBatch.from_worker_batch(batch, device, pool)
    backend = create_attention_backend("torch_native", num_heads, num_kv_heads)
    backend.init_forward_metadata(fb)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)

    out = backend.forward(q.to(device), k.to(device), v.to(device), 0, fb).cpu()
    k_cache, v_cache = pool.k_buffers[0].cpu(), pool.v_buffers[0].cpu()

    assert out.shape == q.shape
    assert torch.equal(k_cache[out_cache_loc], k)
    assert torch.equal(v_cache[out_cache_loc], v)
    start = 0
    for i, (p, e) in enumerate(lens):
        rows = slice(start, start + e)
        expected = reference(
            q[rows], torch.cat([cached_k[i], k[rows]]), torch.cat([cached_v[i], v[rows]]), p
        )
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
        start += e
