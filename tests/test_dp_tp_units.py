"""The pure parts of scale-out: the batch rank 0 broadcasts survives its bytes, the
data-parallel routers pick replicas as they should, and each node knows which ranks it runs."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
from test_sampler import make_info
from test_tensor_parallel import make_batch

from radixserve.launch import local_placements
from radixserve.model_worker.batch_codec import decode_batch, encode_batch
from radixserve.protocol.internal import ReplicaLoad
from radixserve.scheduler.dp_controller import sum_server_info
from radixserve.scheduler.dp_router import (
    PAGE_TOKENS,
    CacheAwareRouter,
    ReplicaLoads,
    RoundRobinRouter,
)
from radixserve.scheduler.seen_tokens import SeenTokens
from radixserve.server_args import ServerArgs, check_parallel_args


def assert_same(a: object, b: object) -> None:
    for field in fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), field.name
        elif hasattr(x, "__dataclass_fields__"):
            assert_same(x, y)
        else:
            assert x == y, field.name


def test_a_broadcast_batch_decodes_to_the_batch_sent() -> None:
    # Mixed lengths (the slot table is mostly padding) and penalised rows (nested tensors).
    batch = make_batch([(0, 7), (40, 1), (3, 2)], torch.randperm(200) + 1)
    seen = {0: SeenTokens.of([5, 6, 5], [9]), 2: SeenTokens.of([1], [])}
    batch.sampling = make_info(
        3, temperatures=[0.0, 0.7, 1.0], frequency_penalties=[0.5, 0, 1], seen=seen
    )
    data = encode_batch(batch)
    assert_same(decode_batch(data), batch)
    # Each sequence's slots travel, not the padding: more of it changes no byte.
    wider = replace(batch, kv_slots=torch.nn.functional.pad(batch.kv_slots, (0, 100)))
    assert encode_batch(wider) == data
    # A speculating batch: its followers verify the same drafts (its sequences' last inputs).
    drafted = replace(batch, draft_lens=torch.tensor([3, 0, 1]))
    assert_same(decode_batch(encode_batch(drafted)), drafted)


def test_a_broadcast_batch_whose_lengths_disagree_is_refused() -> None:
    """A TP follower decodes rank 0's bytes: a batch whose lengths disagree would have the
    kernels read out of bounds, so it is a clean error instead."""
    batch = make_batch([(0, 7), (40, 1), (3, 2)], torch.randperm(200) + 1)
    batch.sampling = make_info(3, temperatures=[0.0, 0.7, 1.0])
    tampered = {
        "the extend lengths sum to the tokens": {"extend_lens": torch.tensor([7, 1, 1])},
        "lengths >= 0": {"prefix_lens": torch.tensor([0, -40, 3])},
        "one entry per token": {"positions": torch.arange(9)},
    }
    short = replace(batch.sampling, temperatures=torch.tensor([0.0, 0.7]))
    cases = [(rule, replace(batch, **changes)) for rule, changes in tampered.items()]
    cases.append(("one per sequence", replace(batch, sampling=short)))
    for rule, wrong in cases:
        data = encode_batch(wrong)
        with pytest.raises(ValueError, match=rule):
            decode_batch(data)


def test_round_robin_takes_turns() -> None:
    router, loads = RoundRobinRouter(), ReplicaLoads(3)
    assert [router.pick([1, 2], loads) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert loads.sent == [3, 2, 2]  # one count of what was sent: the router's picks


def test_cache_aware_keeps_a_prefix_family_on_one_replica_and_spreads_new_ones() -> None:
    router = CacheAwareRouter(2)
    families = [list(range(f * 1000, f * 1000 + 4 * PAGE_TOKENS)) for f in range(4)]
    idle = ReplicaLoads(2)  # the replicas finish each request before the next comes

    def pick(ids: list[int]) -> int:
        replica = router.pick(ids, idle)
        idle.report(ReplicaLoad(dp_rank=replica, received=idle.sent[replica], in_flight=0))
        return replica

    picks = {f: {pick(prefix + [f, i]) for i in range(5)} for f, prefix in enumerate(families)}
    assert all(len(p) == 1 for p in picks.values())  # a family stays where its prefix is
    assert sorted(p.pop() for p in picks.values()) == [0, 0, 1, 1]  # new families spread
    short = [pick([7]) for _ in range(4)]  # no whole page: taken in turn
    assert sorted(short) == [0, 0, 1, 1]


def test_cache_aware_goes_to_the_least_loaded_past_both_imbalance_thresholds() -> None:
    """SGLang router's rule: the prefix decides while the replicas are balanced; once the
    busiest has more than --balance-abs-threshold over the idlest and more than
    --balance-rel-threshold times as many, the least loaded gets the request, and from then on
    the replicas holding the prefix share it by load."""
    router = CacheAwareRouter(2, balance_abs_threshold=4, balance_rel_threshold=1.5)
    shared = list(range(4 * PAGE_TOKENS))
    loads = ReplicaLoads(2)
    # All in flight at once: each request adds to its replica's load.
    picks = [router.pick(shared + [i], loads) for i in range(20)]
    assert picks[:5] == [0] * 5  # 5 - 0 > 4: imbalanced from here
    assert picks[5] == 1
    assert sorted(loads.now()) == [10, 10]  # then by load among the replicas that hold the prefix
    assert router.imbalanced([10, 5]) and router.imbalanced([1, 7])
    assert not router.imbalanced([9, 5])  # 4 over: not past the absolute threshold
    assert not router.imbalanced([20, 15])  # 5 over, but not 1.5 times as many


def test_replica_loads_count_what_was_sent_and_not_yet_received() -> None:
    loads = ReplicaLoads(2)
    loads.sent = [5, 2]
    assert loads.now() == [5, 2]
    loads.report(ReplicaLoad(dp_rank=0, received=4, in_flight=3))  # one finished, one on its way
    assert loads.now() == [4, 2]


def test_replicas_server_info_sums_and_weights_the_hit_rate() -> None:
    from radixserve.protocol.wire import ServerInfoReply

    def info(dp_rank: int, prompt: int, rate: float) -> ServerInfoReply:
        return ServerInfoReply(1, 0, 10, 100, rate, 5.0, 3, 0, 0, 0, 7, 8, prompt, dp_rank)

    total = sum_server_info([info(1, 300, 0.5), info(0, 100, 0.1)])
    assert (total.running_requests, total.kv_tokens_total, total.prompt_tokens) == (2, 200, 400)
    assert abs(total.cache_hit_rate - (150 + 10) / 400) < 1e-9
    assert [r.dp_rank for r in total.replicas] == [1, 0]


def test_each_node_runs_its_share_of_every_replicas_ranks() -> None:
    args = ServerArgs(tp_size=4, dp_size=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert check_parallel_args(args) is None
    placed = [(p.dp_rank, p.tp_rank, p.dist_init_addr) for p in local_placements(args)]
    assert placed == [
        (0, 2, "10.0.0.1:5000"),
        (0, 3, "10.0.0.1:5000"),
        (1, 2, "10.0.0.1:5001"),
        (1, 3, "10.0.0.1:5001"),
    ]
    assert [p.process_name for p in local_placements(args)][2] == "scheduler_dp1_tp2"


def test_each_model_process_of_a_node_gets_its_own_gpu_or_a_refusal_in_words(monkeypatch) -> None:
    """The GPUs a node's model processes take (as many as the test says are visible), and the
    placements NCCL or CUDA would refuse, refused first: two ranks of one TP group on one GPU
    was NCCL's "Duplicate GPU detected" on a one-GPU H100 box, 2026-11-27, and `--device cuda`
    with none a ZeroDivisionError. (A scheduler's ValueError at start reaches the launcher's log
    as one line: test_launch.py.)"""
    from radixserve.scheduler.rank_setup import _rank_gpu

    def gpus(visible: int, device: str = "cuda", **flags: object) -> list[int | None]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        args = ServerArgs(device=device, **flags)
        return [_rank_gpu(torch.device(device), args, p).index for p in local_placements(args)]

    assert gpus(4, tp_size=2, dp_size=2) == [0, 1, 2, 3]
    assert gpus(1, dp_size=2) == [0, 0]  # replicas share a GPU: two TP groups of one rank
    # node 1 of two, 4 GPUs: its share of each replica's ranks, every GPU once
    two_nodes = dict(tp_size=4, dp_size=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert gpus(4, **two_nodes) == [0, 1, 2, 3]
    assert gpus(2, "cuda:1") == [1]
    refusals = {
        (0, "cuda", 1): "--device cuda, but no GPU is visible",
        (1, "cuda", 2): "--tp-size 2 needs 2 GPUs on this node, one per TP rank; 1 is visible",
        (2, "cuda:2", 1): "--device cuda:2, but GPUs 0 to 1 are visible",
        (2, "cuda:0", 2): "--device cuda:0 puts all 2 TP ranks on one GPU",
    }
    for (visible, device, tp_size), message in refusals.items():
        with pytest.raises(ValueError, match=message):
            gpus(visible, device, tp_size=tp_size)


def test_parallel_flags_that_do_not_fit_are_named() -> None:
    wrong = {
        "--tp-size 3 does not split over --nnodes 2": dict(
            tp_size=3, nnodes=2, dist_init_addr="h:1"
        ),
        "--node-rank must be in 0..1": dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"),
        "needs --dist-init-addr": dict(tp_size=2, nnodes=2),
        "is not host:port": dict(dist_init_addr="localhost"),
        "'localhost:' is not host:port": dict(dist_init_addr="localhost:"),
        "':31725' is not host:port": dict(dist_init_addr=":31725"),
        "9999999' is not host:port": dict(dist_init_addr="h:" + "9" * 5000),  # past int()'s digits
        "ports 65535-65536 are not all in 1-65535": dict(dist_init_addr="h:65535", dp_size=2),
        "ports 99999-99999": dict(dist_init_addr="h:99999"),
        "takes --port 30000": dict(dist_init_addr="h:29999", dp_size=2),
        "takes --http-port 30080": dict(dist_init_addr="h:30080"),
        "must be at least 1": dict(dp_size=0),
    }
    for message, fields_ in wrong.items():
        mistake = check_parallel_args(ServerArgs(**fields_))
        assert mistake is not None and message in mistake, (fields_, mistake)
