"""Invariants the scheduler must keep after every step; checked when --check-invariants is on
(the tests turn it on). Costs O(KV pool) per step, so it is off in production."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.scheduler.schedule_batch import ScheduleBatch
    from radixserve.scheduler.scheduler import Scheduler


class InvariantError(AssertionError):
    pass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)


def check_invariants(s: Scheduler, batch: ScheduleBatch | None) -> None:
    cfg = s.config
    waiting_ids = [id(r) for r in s.waiting]
    running_ids = [id(r) for r in s.running]
    _require(len(set(waiting_ids)) == len(waiting_ids), "a request is twice in the waiting queue")
    _require(len(set(running_ids)) == len(running_ids), "a request is twice in the running batch")
    _require(not set(waiting_ids) & set(running_ids), "a request is both waiting and running")
    _require(len(s.running) <= cfg.max_running_requests, "more running requests than the cap")
    for req in s.waiting:
        _require(not req.finished, f"finished request {req.rid} still waiting")
        _require(req.req_pool_idx is None, f"waiting request {req.rid} holds a row")
        _require(
            req.last_node is None and req.num_computed_tokens == 0,
            f"waiting request {req.rid} holds KV",
        )
    for req in s.running:
        _require(not req.finished, f"finished request {req.rid} still running")
        _require(req.req_pool_idx is not None, f"running request {req.rid} holds no row")
    if batch is not None:
        _require(batch.num_tokens <= cfg.max_prefill_tokens, "the step went over its token budget")
        _require(all(n > 0 for n in batch.extend_lens), "a request computes nothing")
        _require(
            sum(n for n in batch.extend_lens if n > 1) <= cfg.chunked_prefill_size,
            "the step's prompt tokens went over --chunked-prefill-size",
        )

    # Every KV slot is exactly one of: free, owned by the tree, or owned by one running request.
    tree = s.kv.tree_cache
    pool = s.kv.req_to_token_pool.req_to_token
    owned = [pool[r.req_pool_idx, r.prefix_len : r.num_computed_tokens] for r in s.running]
    tree_slots = [tree.all_slots()] if tree is not None else []
    every = torch.cat([s.kv.allocator.free_slots(), *tree_slots, *owned])
    _require(
        every.numel() == cfg.max_total_tokens,
        f"{every.numel()} slots accounted for, {cfg.max_total_tokens} exist: a slot leaked or is "
        "owned twice",
    )
    _require(
        torch.equal(torch.sort(every).values, torch.arange(1, cfg.max_total_tokens + 1)),
        "a KV slot is owned twice, or slot 0 was handed out",
    )
    # Past its computed tokens a row holds zeros: the batch's kv_slots rely on it for padding.
    written = torch.zeros_like(pool, dtype=torch.bool)
    for r in s.running:
        written[r.req_pool_idx, : r.num_computed_tokens] = True
    _require(not pool.masked_fill(written, 0).any(), "a row holds a slot past its tokens")
    rows = {r.req_pool_idx for r in s.running}
    _require(
        s.kv.req_to_token_pool.num_free + len(rows) == cfg.max_running_requests,
        "a request row leaked",
    )
    if tree is not None:
        _require(
            tree.evictable_size + tree.protected_size == tree.total_size,
            "the tree's evictable and protected sizes do not add up",
        )
        for req in s.running:
            node = req.last_node
            _require(
                node is not None and (node is tree.root or node.lock_ref > 0),
                f"running request {req.rid} does not lock its prefix",
            )
    if not s.has_unfinished():
        _require(s.kv.available == cfg.max_total_tokens, "idle, yet some KV is not reusable")
