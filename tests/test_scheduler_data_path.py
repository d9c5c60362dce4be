"""The data path's conversions read and never write, and what a request reports is counted once.
Real scheduler and pools, fake model worker."""

from __future__ import annotations

import dataclasses
import random

import torch
from fake_worker import reference_tokens
from test_scheduler import gen, make_scheduler, prompt, run_to_completion, tokens_of

from radixserve.model_worker.batch import ModelWorkerBatch


def assert_same(a: object, b: object, where: str = "batch") -> None:
    """Field by field, tensors by value (dtype and shape too), through nested dataclasses."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_converting_a_schedule_batch_twice_gives_equal_model_worker_batches() -> None:
    """A mixed step (decodes, a prefill chunk, a fresh prompt; penalties, seeds, logprobs),
    converted twice: equal ModelWorkerBatches, and no KV bookkeeping or request state moved."""
    s = make_scheduler(chunk=48, budget=96)
    rng = random.Random(7)
    prompts = {f"r{i}": prompt(rng, n) for i, n in enumerate((12, 9, 150, 20))}
    params = [
        {"frequency_penalty": 0.5, "seed": 3},
        {"temperature": 0.7, "top_k": 5},
        {"repetition_penalty": 1.2},
        {},
    ]
    for (rid, p), extra in zip(prompts.items(), params):
        msg = gen(rid, p, 6, **extra)
        msg.return_logprob, msg.top_logprobs_num = True, 2
        s.add_request(msg)
        s.step()
    batch = s.get_next_batch_to_run()
    assert batch is not None and batch.is_mixed and not all(batch.emits)
    pool = s.kv.req_to_token_pool.req_to_token.clone()
    state = [(r.num_computed_tokens, r.kv, r.seen, list(r.output_ids)) for r in batch.reqs]

    first = batch.to_model_worker_batch(s.kv, s.sampling_rows)
    second = batch.to_model_worker_batch(s.kv, s.sampling_rows)
    assert isinstance(first, ModelWorkerBatch) and first.sampling.penalty_tokens is not None
    assert_same(first, second)
    assert torch.equal(s.kv.req_to_token_pool.req_to_token, pool)
    assert state == [(r.num_computed_tokens, r.kv, r.seen, r.output_ids) for r in batch.reqs]

    # The converted batch is the one that runs: the requests still say what they must.
    s.process_batch_result(batch, s.run_batch(batch).result())
    assert_same(s.worker.batches[-1], first)
    outs = run_to_completion(s)
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 6), rid


def test_a_retracted_request_counts_its_cached_prompt_tokens_once() -> None:
    """A recompute after a retraction finds its own KV in the tree, which is no cache hit: only
    the shared system prompt is. Re-admissions used to count their prompt again (hit rates past
    100% were possible)."""
    rng = random.Random(3)
    system = prompt(rng, 48)
    prompts = {f"r{i}": system + prompt(rng, 40) for i in range(16)}
    s = make_scheduler(pool=600, running=32, budget=256, chunk=128)
    for rid, p in prompts.items():
        s.add_request(gen(rid, p, 60))
    outs = run_to_completion(s)
    assert s.stats.num_retractions > 0
    cached = {rid: o[0].start.cached_tokens for rid, o in outs.items()}
    assert max(cached.values()) == len(system)
    assert s.stats.cached_tokens == sum(cached.values())
    assert s.server_info().cache_hit_rate <= len(system) / (len(system) + 40)
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 60), rid


def test_a_tiny_temperature_makes_a_greedy_batch() -> None:
    """Below 1e-5 a temperature is greedy (as vLLM and SGLang): the batch takes the argmax."""
    s = make_scheduler()
    s.add_request(gen("tiny", [1, 2, 3], 2, temperature=1e-38))
    s.add_request(gen("small", [4, 5, 6], 2, temperature=9e-6))
    s.add_request(gen("greedy", [7, 8, 9], 2, temperature=0.0))
    s.step()
    assert s.worker.batches[-1].sampling.is_all_greedy
    s.add_request(gen("sampled", [1, 2], 2, temperature=1e-5))
    s.step()
    assert not s.worker.batches[-1].sampling.is_all_greedy
