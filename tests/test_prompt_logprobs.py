"""Prompt logprobs (logprob_start_len) through the real scheduler and a fake worker that gives
each prompt row a value from its position and target: chunked prefill, overlap, a small pool that
forces retractions, and prompts already in the prefix cache (which must be computed again)."""

from __future__ import annotations

import random

import pytest
import torch
from fake_worker import FakeModelWorker, reference_tokens
from test_scheduler import gen, make_scheduler

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.model_worker.batch_codec import decode_batch, encode_batch
from radixserve.protocol.internal import ReqError, TokenizedGenerateReq
from radixserve.protocol.wire import MAX_PROMPT_TOP_LOGPROBS
from radixserve.scheduler.scheduler import Scheduler


def fake_logprob(position: int, target: int) -> float:
    return -((target * 31 + position) % 1000) / 8  # exact in float32


class PromptLogprobWorker(FakeModelWorker):
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        out = super().forward(batch)
        rows, targets = batch.prompt_logprob_rows, batch.prompt_logprob_targets
        if rows is not None and targets is not None:
            # The batch reaches other TP ranks with its prompt rows.
            again = decode_batch(encode_batch(batch))
            assert again.prompt_logprob_rows is not None
            assert torch.equal(again.prompt_logprob_rows, rows)
            assert again.prompt_top_logprobs_num == batch.prompt_top_logprobs_num
            positions = batch.positions[rows].tolist()
            values = [fake_logprob(p, t) for p, t in zip(positions, targets.tolist())]
            k = batch.prompt_top_logprobs_num
            out.prompt_logprobs = torch.tensor(values)
            out.prompt_top_logprobs = torch.zeros(len(values), k)
            out.prompt_top_logprob_ids = torch.zeros(len(values), k, dtype=torch.int64)
        return out


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_survive_chunks_cache_hits_and_retraction(overlap):
    config = make_scheduler(
        pool=600, running=32, budget=160, chunk=48, enable_overlap=overlap
    ).config
    s = Scheduler(config, PromptLogprobWorker(600))
    rng = random.Random(5)
    shared = [rng.randrange(1, 1000) for _ in range(70)]
    prompts = {
        f"r{i}": [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 110))] for i in range(12)
    }
    prompts["again0"] = prompts["again1"] = shared
    starts = {rid: (-1 if i % 4 == 3 else i % 3 * 5) for i, rid in enumerate(prompts)}
    max_new = {rid: 0 if i % 5 == 1 else 40 for i, rid in enumerate(prompts)}
    # The shared prompt goes in once without prompt logprobs, so that the cache holds it.
    s.add_request(gen("warm", shared, 2))
    while s.has_unfinished():
        s.step()
    s.outbox = []
    for rid, prompt in prompts.items():
        msg = gen(rid, prompt, max_new[rid])
        msg.return_logprob = True
        msg.logprob_start_len = starts[rid]
        s.add_request(msg)
    finals = {}
    outputs: dict[str, list[int]] = {}
    while s.has_unfinished():
        s.step()
        for out in s.outbox:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished_reason is not None:
                finals[out.rid] = out
        s.outbox = []
    assert s.stats.num_retractions > 0
    for rid, prompt in prompts.items():
        final, start = finals[rid], starts[rid]
        if start < 0:
            assert final.input_token_logprobs is None
            continue
        expected = [
            (fake_logprob(q - 1, prompt[q]), prompt[q]) for q in range(max(start, 1), len(prompt))
        ]
        if start == 0:
            expected.insert(0, (None, prompt[0]))
        assert [tuple(e) for e in final.input_token_logprobs] == expected, rid
        assert outputs.get(rid, []) == reference_tokens(prompt, max_new[rid]), rid


def test_prompt_top_logprobs_in_all_are_bounded_naming_the_field():
    """256 top logprobs a position over a long prompt is tens of millions of pairs held for one
    request: past MAX_PROMPT_TOP_LOGPROBS in all it is refused with its rid; the same prompt
    scored from later on, or with fewer top logprobs, is taken."""
    n = MAX_PROMPT_TOP_LOGPROBS // 256 + 2  # 2 positions too many at 256
    s = make_scheduler(pool=2 * n, budget=n, chunk=n, context=2 * n)
    prompt = [1 + i % 900 for i in range(n)]

    def ask(rid: str, top: int, start: int) -> TokenizedGenerateReq:
        msg = gen(rid, prompt, 0)
        msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len = True, top, start
        return msg

    error = s.add_request(ask("whole", 256, 0))
    assert isinstance(error, ReqError) and (error.rid, error.code) == ("whole", "invalid_request")
    assert error.message.startswith("top_logprobs_num: 256 top logprobs for each of")
    assert s.add_request(ask("later", 256, 2)) is None  # n - 2 positions: exactly the bound
    assert s.add_request(ask("fewer", 1, 0)) is None
