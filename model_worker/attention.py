"""Attention backends over the paged KV pool, behind one small interface.

`TorchNativeBackend` runs anywhere torch runs (CPU and CUDA) on
`torch.nn.functional.scaled_dot_product_attention`, and is the reference; faster backends
implement the same two methods (`cpu_attention.py`) and are chosen in `kernel_selection.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model_worker.forward_batch import ForwardBatch

# On a GPU, SDPA's cuDNN backend builds a plan for each new shape, and a decode batch's KV length
# grows by one a step: padded to a multiple of this, a batch builds one plan per 128 steps, not one
# a step (each ~2-3 ms a layer on an H100: benchmarks/RESULTS.md, "On a GPU"). Padding is masked;
# on the CPU it would only cost.
GPU_KV_LEN_BUCKET = 128


class AttentionBackend(ABC):
    """Contract: `init_forward_metadata(fb)` runs once per forward, before the first layer, and
    stores in `fb.attn_metadata` every index tensor its `forward` needs. `forward` runs once per
    layer: it writes the new tokens' K and V to the pool at `fb.out_cache_loc`, then lets each
    new token attend, causally, to its own sequence's cached and new tokens."""

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> [T, heads, head_dim]."""


@dataclass(slots=True)
class _PaddedGroup:
    """Sequences attended as one padded batch: n sequences, q_max query rows each, against
    k_max KV slots each. Rows past a sequence's extend_len and slots past its seq_len are
    padding; no real query row ever sees a padding slot."""

    query_tokens: torch.Tensor  # int64 [n, q_max]: the packed token of each query row
    kv_slots: torch.Tensor  # int64 [n, k_max]
    # [n, 1, q_max, k_max], bool (float 0/-inf for decodes), shared by every head. None when
    # n == 1: one sequence has no padding, and its bottom-right-aligned causal mask is implicit.
    mask: torch.Tensor | None


@dataclass(slots=True)
class _TorchMetadata:
    groups: list[_PaddedGroup]  # one or two
    # int64 [T]: where each packed token lands in the groups' rows; None when they already are in
    # token order (all decodes, or one prefill), which saves a gather per layer.
    row_of_token: torch.Tensor | None


class TorchNativeBackend(AttentionBackend):
    """Decodes and extends attend as two padded batches, so that a long prefill does not pad
    every decode to its length. Per layer: one write to the pool, then per group one gather of
    queries, one gather of K and of V, and one SDPA call; one gather puts the rows back in token
    order. No Python loop runs over requests.

    A group of one sequence (a lone prefill, say) needs no mask tensor at all: SDPA's
    bottom-right causal bias expresses it, in O(1) memory rather than O(q_len * kv_len).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, kv_len_bucket: int = 1):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kv_len_bucket = kv_len_bucket  # batched groups' KV length: a multiple of this

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        # Built on the CPU from the CPU copies of the lengths, moved to the device once.
        extend_start = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens
        is_decode = fb.extend_lens == 1
        groups: list[_PaddedGroup] = []
        row_of_token = torch.empty(int(fb.extend_lens.sum()), dtype=torch.int64)
        rows_before = 0
        for members in (is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0]):
            if members.numel() == 0:
                continue
            group, tokens, rows = self._padded_group(fb, members, extend_start[members])
            row_of_token[tokens] = rows + rows_before
            rows_before += group.query_tokens.numel()
            groups.append(group)
        in_order = rows_before == len(row_of_token) and torch.equal(
            row_of_token, torch.arange(len(row_of_token))
        )
        fb.attn_metadata = _TorchMetadata(
            groups=[_to_device(g, fb.device) for g in groups],
            row_of_token=None if in_order else row_of_token.to(fb.device),
        )

    def _padded_group(
        self, fb: ForwardBatch, members: torch.Tensor, extend_start: torch.Tensor
    ) -> tuple[_PaddedGroup, torch.Tensor, torch.Tensor]:
        """The group, and for each of its real tokens: the packed index and the group row."""
        prefix = fb.prefix_lens[members]
        extend = fb.extend_lens[members]
        q_max = int(extend.max())
        k_max = int((prefix + extend).max())
        kv_slots = fb.kv_slots[members, :k_max]
        batched = len(members) > 1
        if batched and self.kv_len_bucket > 1:
            padded = (k_max + self.kv_len_bucket - 1) // self.kv_len_bucket * self.kv_len_bucket
            kv_slots = F.pad(kv_slots, (0, padded - k_max))  # slot 0: padding
            k_max = padded
        # ┌ sequence s, query row i (i < extend[s]) ┐   sees KV position j iff j <= prefix[s] + i
        # │ kv: [ cached 0..prefix-1 | new 0..i .. ]│   rows i >= extend[s] are padding: they
        # └─────────────────────────────────────────┘   reuse the last real token and are dropped
        offsets = torch.arange(q_max)
        real = offsets[None, :] < extend[:, None]  # [n, q_max]
        query_tokens = extend_start[:, None] + torch.minimum(offsets[None, :], extend[:, None] - 1)
        mask = None
        if batched:
            visible = torch.arange(k_max)[None, None, :] <= (prefix[:, None] + offsets)[:, :, None]
            mask = visible[:, None]
            if q_max == 1:
                # Decodes, the hot path: SDPA on CPU runs ~20% faster with an additive float
                # mask than with a boolean one. Extends keep the boolean: 4x less memory.
                mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        group = _PaddedGroup(query_tokens, kv_slots, mask)
        rows = torch.arange(real.numel()).view_as(real)
        return group, query_tokens[real], rows[real]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        meta = fb.attn_metadata
        assert isinstance(meta, _TorchMetadata), "init_forward_metadata was not called"
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = fb.kv_pool.get_kv(layer_id)
        outs = []
        for g in meta.groups:
            qg = q.index_select(0, g.query_tokens.view(-1))
            kg = _gather_slots(k_cache, g.kv_slots)
            vg = _gather_slots(v_cache, g.kv_slots)
            if g.mask is None:
                outs.append(_attend_one(qg, kg, vg))
            else:
                outs.append(self._attend_padded(qg, kg, vg, g.mask))
        rows = outs[0] if len(outs) == 1 else torch.cat(outs)
        return rows if meta.row_of_token is None else rows.index_select(0, meta.row_of_token)

    def _attend_padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [n * q_max, heads, d], k and v [n, kv_heads, k_max, d] -> [n * q_max, heads, d]."""
        n = k.shape[0]
        heads, head_dim = q.shape[1:]
        q = q.view(n, -1, heads, head_dim).transpose(1, 2)
        # SDPA's own GQA: on the CPU ~1.8x faster for decodes than folding each KV head's query
        # heads into the query-row axis (which repeats the mask too).
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(-1, heads, head_dim)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence: q [q_len, heads, d], k and v [1, kv_heads, kv_len, d] -> [q_len, heads, d].

    Its last query row is its last KV position: causal aligned to the bottom right.
    """
    # Imported here: torch.nn.attention.bias imports torch._dynamo, ~1.1 s of every scheduler's
    # start, and only this path (the reference kernels') uses it.
    from torch.nn.attention.bias import causal_lower_right

    causal = causal_lower_right(q.shape[0], k.shape[2])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=causal, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_slots, kv_heads, d], slots [n, k_max] -> [n, kv_heads, k_max, d]."""
    # index_select on the flattened slots: ~6x faster on CPU than advanced indexing cache[slots].
    gathered = cache.index_select(0, slots.view(-1))
    return gathered.view(*slots.shape, *cache.shape[1:]).transpose(1, 2)


def _to_device(g: _PaddedGroup, device: torch.device) -> _PaddedGroup:
    return _PaddedGroup(
        query_tokens=g.query_tokens.to(device),
        kv_slots=g.kv_slots.to(device),
        mask=None if g.mask is None else g.mask.to(device),
    )
