"""logit_bias and min_new_tokens: the sampler adds each row's biases before penalties (-inf on
the stop tokens of a request still short of min_new_tokens), and the scheduler builds those
entries step by step from each request's parameters and outputs so far."""

from __future__ import annotations

import msgspec
import pytest
import torch
from fake_worker import EOS
from test_sampler import CPU, make_info, random_logits
from test_scheduler import gen, make_scheduler

from radixserve.model_worker.batch import LogitBias
from radixserve.model_worker.batch_codec import decode_batch, encode_batch
from radixserve.model_worker.penalties import apply_logit_bias, apply_penalties
from radixserve.model_worker.sampler import Sampler
from radixserve.protocol.wire import MAX_LOGIT_BIAS, SamplingParams
from radixserve.scheduler.seen_tokens import SeenTokens


def bias(rows: list[int], tokens: list[int], values: list[float]) -> LogitBias:
    return LogitBias(torch.tensor(rows), torch.tensor(tokens), torch.tensor(values))


def test_bias_moves_greedy_and_sampled_rows_and_leaves_logprobs_raw() -> None:
    logits = random_logits(3, seed=3)
    top = logits.argmax(-1).tolist()
    info = make_info(
        3,
        temperatures=[0.0, 1.0, 0.0],
        return_logprob=[True, True, False],
        top_logprobs_nums=[1, 1, 0],
    )
    # Row 0: its argmax banned; row 1: token 7 all but forced while sampling at temperature 1;
    # row 2: token 9 raised past the max, and raised twice (the additions sum).
    info.logit_bias = bias([0, 1, 2, 2], [top[0], 7, 9, 9], [-100.0, 100.0, 30.0, 30.0])
    biased = apply_logit_bias(logits, info)
    assert biased[0, top[0]] == logits[0, top[0]] - 100 and biased[2, 9] == logits[2, 9] + 60
    assert torch.equal(biased[1, :7], logits[1, :7])
    sampler = Sampler(CPU, seed=0)
    for _ in range(20):
        out = sampler(logits, info)
        assert out.next_token_ids.tolist() == [biased[0].argmax().item(), 7, 9]
        assert out.next_token_ids[0] != top[0]
        # Logprobs are the model's own, before any bias.
        raw = torch.log_softmax(logits, -1)
        assert torch.allclose(out.token_logprobs[:2], raw[[0, 1], out.next_token_ids[:2]])


def test_bias_comes_before_penalties() -> None:
    """A repetition penalty of 2 halves a positive logit: a bias added first is halved too."""
    logits = torch.zeros(1, 10)
    info = make_info(1, repetition_penalties=[2.0], seen={0: SeenTokens.of([4], [])})
    info.logit_bias = bias([0], [4], [10.0])
    assert apply_penalties(apply_logit_bias(logits, info), info)[0, 4] == 5.0


def test_the_scheduler_masks_stop_tokens_until_min_new_tokens_and_carries_logit_bias() -> None:
    """Through the real scheduler (chunked prefill, several requests): each step's batch holds,
    for a request with min_new_tokens m, -inf on EOS and its stop_token_ids exactly while the row
    samples one of its first m outputs, and its logit_bias on every sampling step; a request
    with neither has no entry. The batch travels to other TP ranks with its biases."""
    s = make_scheduler(chunk=16, budget=64)
    s.add_request(
        gen("min", list(range(1, 40)), 8, ignore_eos=False, min_new_tokens=5, stop_token_ids=[42])
    )
    s.add_request(gen("bias", list(range(50, 60)), 6, logit_bias={3: -100.0, 11: 2.5}))
    s.add_request(gen("plain", list(range(70, 75)), 6))
    seen_mask = seen_after = 0
    while s.has_unfinished():
        batch = s.step()
        assert batch is not None
        sent = s.worker.batches[-1]
        entries = sent.sampling.logit_bias
        got: dict[str, dict[int, float]] = {}
        if entries is not None:
            for row, token, value in zip(
                entries.batch_rows.tolist(), entries.token_ids.tolist(), entries.biases.tolist()
            ):
                got.setdefault(batch.reqs[row].rid, {})[token] = value
            again = decode_batch(encode_batch(sent)).sampling.logit_bias
            assert again is not None and torch.equal(again.biases, entries.biases)
        # A step with no entry ships none: the sampler's fast paths stay open.
        assert (entries is None) == (not got)
        for i, req in enumerate(batch.reqs):
            index = int(batch.columns[3][i])
            if req.rid == "min":
                if index < 5:
                    assert got["min"] == {EOS: float("-inf"), 42: float("-inf")}, index
                    seen_mask += 1
                else:
                    assert "min" not in got
                    seen_after += 1
            elif req.rid == "bias":
                assert got["bias"] == {3: -100.0, 11: 2.5}
            else:
                assert req.rid not in got
        s.outbox = []
    assert seen_mask >= 5 and seen_after >= 1


def test_sampling_params_limits() -> None:
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    for bad in ({"1": 101}, {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}):
        with pytest.raises(msgspec.ValidationError, match="logit_bias"):
            msgspec.json.decode(msgspec.json.encode({"logit_bias": bad}), type=SamplingParams)
