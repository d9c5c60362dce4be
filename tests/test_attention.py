"""Each attention backend against a naive per-sequence float64 reference, on mixed batches:
decodes, prefills, prefill chunks over a cached prefix, unsorted, GQA/MQA/MHA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from test_sampler import make_info

from radixserve.model_worker.attention import TorchNativeBackend
from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.kernel_selection import select_kernels
from radixserve.model_worker.kv_pool import TokenToKVPool

HEAD_DIM = 8  # below one AVX2 vector: the kernel's tail paths run too
NUM_SLOTS = 400
# "padded": torch_native with batched groups' KV length padded to a multiple of 16, as it pads
# to 128 on a GPU; run on any device, so that the CPU checks the padding is masked.
BACKENDS = ["torch_native", "cpu_extension", "padded"]


@dataclass
class AttentionCase:
    fb: ForwardBatch
    q: torch.Tensor  # [T, heads, D], CPU
    k: torch.Tensor  # [T, kv_heads, D], CPU: the new tokens'
    v: torch.Tensor
    cached_k: list[torch.Tensor]  # per sequence: its prefix's K, CPU
    cached_v: list[torch.Tensor]


def make_batch(
    pool: TokenToKVPool, lens: list[tuple[int, int]], num_heads: int, gen: torch.Generator
) -> AttentionCase:
    """A batch of sequences (prefix_len, extend_len) on shuffled slots of layer 0 of `pool`,
    their prefixes' K and V already written there."""
    device = pool.k_buffers[0].device
    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    free = (torch.randperm(pool.num_slots - 1, generator=gen) + 1).tolist()
    prefix = torch.tensor([p for p, _ in lens])
    extend = torch.tensor([e for _, e in lens])
    kv_slots = torch.zeros(len(lens), int((prefix + extend).max()), dtype=torch.int64)
    cached_k, cached_v = [], []
    for i, (p, e) in enumerate(lens):
        kv_slots[i, : p + e] = torch.tensor([free.pop() for _ in range(p + e)])
        cached_k.append(torch.randn(p, num_kv_heads, head_dim, generator=gen))
        cached_v.append(torch.randn(p, num_kv_heads, head_dim, generator=gen))
        kv = {"device": device, "dtype": pool.k_buffers[0].dtype}
        pool.set_kv(0, kv_slots[i, :p].to(device), cached_k[-1].to(**kv), cached_v[-1].to(**kv))
    num_tokens = int(extend.sum())
    batch = ModelWorkerBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in lens]),
        out_cache_loc=torch.cat([kv_slots[i, p : p + e] for i, (p, e) in enumerate(lens)]),
        prefix_lens=prefix,
        extend_lens=extend,
        kv_slots=kv_slots,
        sampling=make_info(0),
    )
    return AttentionCase(
        fb=ForwardBatch.from_worker_batch(batch, device, pool),
        q=torch.randn(num_tokens, num_heads, head_dim, generator=gen),
        k=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        v=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        cached_k=cached_k,
        cached_v=cached_v,
    )


def run_backend(name: str, case: AttentionCase) -> torch.Tensor:
    device = case.fb.device
    heads, kv_heads = case.q.shape[1], case.k.shape[1]
    if name == "padded":
        attn = TorchNativeBackend(heads, kv_heads, kv_len_bucket=16)
    else:
        attn = select_kernels(name, heads, kv_heads, device, torch.float32).attn_backend
    attn.init_forward_metadata(case.fb)
    return attn.forward(case.q.to(device), case.k.to(device), case.v.to(device), 0, case.fb).cpu()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q [n, H, D] of positions prefix..prefix+n-1; k, v [prefix + n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    query_pos = torch.arange(q.shape[0])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", BACKENDS)
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
        (4, 2, [(70, 1), (0, 90), (100, 40)]),  # several key and query blocks per sequence
    ],
)
def test_matches_reference(
    device: torch.device,
    backend: str,
    num_heads: int,
    num_kv_heads: int,
    lens: list[tuple[int, int]],
) -> None:
    if backend == "cpu_extension" and device.type != "cpu":
        pytest.skip("the CPU extension runs on the CPU")
    pool = TokenToKVPool(NUM_SLOTS, 1, num_kv_heads, HEAD_DIM, dtype=torch.float32, device=device)
    # Padding reads slot 0: make it loud, so that a mask letting it through fails the test.
    pool.k_buffers[0][0] = 1e4
    pool.v_buffers[0][0] = 1e4
    case = make_batch(pool, lens, num_heads, torch.Generator().manual_seed(0))

    out = run_backend(backend, case)
    k_cache, v_cache = pool.k_buffers[0].cpu(), pool.v_buffers[0].cpu()
    out_cache_loc = case.fb.out_cache_loc.cpu()

    assert out.shape == case.q.shape
    assert torch.equal(k_cache[out_cache_loc], case.k)
    assert torch.equal(v_cache[out_cache_loc], case.v)
    start = 0
    for i, (p, e) in enumerate(lens):
        rows = slice(start, start + e)
        k = torch.cat([case.cached_k[i], case.k[rows]])
        v = torch.cat([case.cached_v[i], case.v[rows]])
        expected = reference(case.q[rows], k, v, p)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
        start += e
