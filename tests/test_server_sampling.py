"""End to end: every sampling parameter and output control of the wire format, on the real default
model, each checked against a reference that would catch it being ignored or wrong."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from radixserve.client import AsyncClient, Client
from radixserve.client.local_server import launched_server, raw_round_trip
from radixserve.model_worker.model_source import default_model_dir

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(hf_model):
    with launched_server("--dtype", "float32", "--check-invariants") as s:
        yield s


def test_top_k_1_equals_greedy(server):
    with Client(server.address, timeout=120) as c:
        greedy = c.generate(PROMPT, sampling_params={"max_new_tokens": 24, "temperature": 0})
        top1 = c.generate(PROMPT, sampling_params={"max_new_tokens": 24, "top_k": 1})
    assert len(greedy.output_ids) == 24
    assert top1.output_ids == greedy.output_ids


def test_repetition_penalty_equals_transformers(server, hf_model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = hf_model.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    with Client(server.address, timeout=120) as c:
        out = c.generate(
            PROMPT,
            sampling_params={"max_new_tokens": 24, "temperature": 0, "repetition_penalty": 1.3},
        )
    assert out.output_ids == ref[0, ids.shape[1] :].tolist()


class OpenAIPenalties(LogitsProcessor):
    """The reference: frequency and presence penalties over the output tokens, as OpenAI."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("frequency, presence", [(0.8, 0.0), (0.0, 1.5), (0.5, 0.5)])
def test_frequency_and_presence_penalties_equal_a_reference(
    server, hf_model, tokenizer, frequency, presence
):
    prompt = "1, 2, 1, 2, 1, 2,"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    penalties = OpenAIPenalties(ids.shape[1], frequency, presence)
    with torch.inference_mode():
        ref = hf_model.generate(
            ids, max_new_tokens=32, do_sample=False, logits_processor=[penalties]
        )
    params = {
        "max_new_tokens": 32,
        "temperature": 0,
        "frequency_penalty": frequency,
        "presence_penalty": presence,
    }
    with Client(server.address, timeout=120) as c:
        out = c.generate(prompt, sampling_params=params)
        plain = c.generate(prompt, sampling_params={"max_new_tokens": 32, "temperature": 0})
    assert out.output_ids == ref[0, ids.shape[1] :].tolist()[: len(out.output_ids)]
    if frequency:
        assert out.output_ids != plain.output_ids  # the penalty really acted


def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(server):
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 1234}

    async def run():
        async with AsyncClient(server.address, timeout=300) as c:
            alone = await c.generate(PROMPT, sampling_params=seeded)
            others = [
                c.generate(
                    f"Tell me fact number {i} about the sea.",
                    sampling_params={"max_new_tokens": 24 + i, "temperature": 0.9},
                )
                for i in range(15)
            ]
            together, *_ = await asyncio.gather(c.generate(PROMPT, sampling_params=seeded), *others)
            other_seed = await c.generate(PROMPT, sampling_params={**seeded, "seed": 99})
            return alone, together, other_seed

    alone, together, other_seed = asyncio.run(run())
    assert together.output_ids == alone.output_ids
    assert other_seed.output_ids != alone.output_ids


def test_stop_string_split_across_streamed_chunks_stops_and_is_trimmed(server):
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Client(server.address, timeout=120) as c:
        chunks = list(c.stream(PROMPT, sampling_params=params))
        full = "".join(ch.text for ch in chunks)
        # a stop string that starts in one streamed chunk and ends in the next
        boundary = len(chunks[0].text) + len(chunks[1].text) + len(chunks[2].text)
        stop = full[boundary - 2 : boundary + 3]
        assert len(stop) == 5 and full.find(stop) == boundary - 2
        stopped = list(c.stream(PROMPT, sampling_params={**params, "stop": [stop]}))
        whole = c.generate(PROMPT, sampling_params={**params, "stop": [stop]})
    text = "".join(ch.text for ch in stopped)
    assert text == full[: boundary - 2]
    assert stopped[-1].meta_info.finish_reason.type == "stop"
    assert stopped[-1].meta_info.finish_reason.matched == stop
    assert sum(ch.finished for ch in stopped) == 1
    assert whole.text == text and whole.meta_info.finish_reason.matched == stop


def test_stop_token_ids_and_matched(server):
    with Client(server.address, timeout=120) as c:
        free = c.generate(PROMPT, sampling_params={"max_new_tokens": 16, "temperature": 0})
        assert len(free.output_ids) == 16
        stop_id = free.output_ids[5]
        out = c.generate(
            PROMPT,
            sampling_params={"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [stop_id]},
        )
    assert out.output_ids == free.output_ids[: free.output_ids.index(stop_id) + 1]
    assert out.meta_info.finish_reason.matched == stop_id


def test_logprobs_equal_log_softmax_of_reference_logits(server, hf_model, tokenizer):
    with Client(server.address, timeout=120) as c:
        out = c.generate(
            PROMPT,
            sampling_params={"max_new_tokens": 8, "temperature": 0},
            return_logprob=True,
            top_logprobs_num=3,
        )
    prompt_ids = tokenizer(PROMPT).input_ids
    ids = torch.tensor([prompt_ids + out.output_ids])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    got = out.meta_info.output_token_logprobs
    assert [t for _, t in got] == out.output_ids
    for step, ((lp, token), top) in enumerate(zip(got, out.meta_info.output_top_logprobs)):
        assert abs(lp - ref[step, token].item()) < 1e-4
        values, top_ids = ref[step].topk(3)
        assert [t for _, t in top] == top_ids.tolist()
        assert max(abs(a - b) for (a, _), b in zip(top, values.tolist())) < 1e-4


def test_n_completions_share_the_prompt_kv(server):
    params = {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "seed": 7}
    prompt = "A prompt that no other test sends: name four colours of autumn leaves."
    with Client(server.address, timeout=120) as c:
        chunks = list(c.stream(prompt, sampling_params=params))
    finals = [ch for ch in chunks if ch.finished]
    assert sorted(ch.index for ch in finals) == [0, 1, 2, 3]
    assert len({ch.rid for ch in chunks}) == 1
    texts = {i: "".join(ch.text for ch in chunks if ch.index == i) for i in range(4)}
    assert len(set(texts.values())) > 1  # independent samples
    prompt_tokens = finals[0].meta_info.prompt_tokens
    # one completion computed the prompt; the other three found it in the prefix cache
    cached = sorted(ch.meta_info.cached_tokens for ch in finals)
    assert cached == [0] + [prompt_tokens - 1] * 3


INVALID = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    ({"no_such_knob": 1}, "no_such_knob"),
    # Past int64: these once passed decoding and killed the scheduler writing its tensors.
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"n": 10**6}, "n"),
    ({"stop": ["x"] * 1000}, "stop"),
    ({"stop": ["x" * 100_000]}, "stop"),
    ({"stop_token_ids": [1] * 100_000}, "stop_token_ids"),
]
INVALID_REQUEST_FIELDS = [
    ({"top_logprobs_num": 2**63, "return_logprob": True}, "top_logprobs_num"),
    ({"top_logprobs_num": 10**6, "return_logprob": True}, "top_logprobs_num"),
]


@pytest.mark.parametrize(
    "fields, field",
    [({"sampling_params": p}, f) for p, f in INVALID] + INVALID_REQUEST_FIELDS,
)
def test_invalid_values_are_refused_by_name_with_the_rid(server, fields, field):
    request = {"type": "generate", "rid": "bad-one", "text": "hi", **fields}
    reply = raw_round_trip(server.address, msgspec.msgpack.encode(request))
    assert reply["type"] == "error" and reply["code"] == "invalid_request"
    assert field in reply["message"]
    assert reply["rid"] == "bad-one"  # a client with many requests in flight knows which failed
    with Client(server.address, timeout=60) as c:  # and the server goes on
        assert c.generate("Hi", sampling_params={"max_new_tokens": 1}).finished


def test_overlong_rid_is_refused_without_echoing_it(server):
    request = {"type": "generate", "rid": "r" * 100_000, "text": "hi"}
    reply = raw_round_trip(server.address, msgspec.msgpack.encode(request))
    assert reply["type"] == "error" and "rid" in reply["message"]
    assert "rid" not in reply


def test_largest_seed_with_n_completions_still_serves(server):
    params = {"seed": 2**63 - 1, "n": 3, "max_new_tokens": 3, "temperature": 1.0}
    with Client(server.address, timeout=60) as c:
        outs = list(c.stream("Hello", sampling_params=params))
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
