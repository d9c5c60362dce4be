"""End to end: every process spawned for real, the default model, real sockets, the client."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.client import AsyncClient, Client, ServerError
from radixserve.client.local_server import launched_server, raw_round_trip
from radixserve.model_worker.model_source import default_model_dir

# Two servers run at once in this module: on a GPU each takes a third of it instead of the
# default 85%, or the second would not fit (on a CPU: their KV pools, a share of the free memory).
GPU_SHARE = ("--mem-fraction-static", "0.3")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_greedy(model_dir, tokenizer) -> list[list[int]]:
    """transformers' own greedy tokens, computed before the server takes the cores."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tokenizer(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=32, do_sample=False)
            outs.append(gen[0, ids.shape[1] :].tolist())
    del model
    return outs


@pytest.fixture(scope="module")
def server(hf_greedy):
    with launched_server(*GPU_SHARE, "--dtype", "float32", "--check-invariants") as s:
        yield s


def test_greedy_tokens_equal_transformers_generate(server, hf_greedy):
    with Client(server.address, timeout=120) as c:
        for prompt, expected in zip(PROMPTS, hf_greedy):
            out = c.generate(prompt, sampling_params={"max_new_tokens": 32, "temperature": 0})
            assert out.output_ids == expected, prompt
            assert out.finished and out.meta_info.completion_tokens == len(expected)


def test_concurrent_requests_exact_lengths_and_a_mixed_step(server, tokenizer):
    max_new = 24

    async def one(c: AsyncClient, i: int, first_chunk: asyncio.Event | None):
        params = {"max_new_tokens": max_new, "temperature": 0.8, "ignore_eos": True}
        ids, text = [], ""
        async for chunk in c.stream(f"Story number {i}: once there was", sampling_params=params):
            ids += chunk.output_ids
            text += chunk.text
            if first_chunk is not None:
                first_chunk.set()
        return ids, text, chunk

    async def main():
        async with AsyncClient(server.address, timeout=300) as c:
            before = (await c.server_info()).num_mixed_steps
            started = asyncio.Event()
            first = [asyncio.create_task(one(c, i, started)) for i in range(8)]
            await started.wait()  # the second wave arrives while the first decodes
            second = [asyncio.create_task(one(c, i, None)) for i in range(8, 16)]
            results = await asyncio.gather(*first, *second)
            return before, results, await c.server_info()

    before, results, info = asyncio.run(main())
    for ids, text, last in results:
        assert len(ids) == max_new
        assert last.finished and last.meta_info.finish_reason.type == "length"
        assert last.meta_info.completion_tokens == max_new
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in text
    assert info.num_mixed_steps > before
    assert info.running_requests == 0 and info.kv_tokens_used == 0


def test_stream_concatenates_to_the_non_streamed_text(server):
    params = {"max_new_tokens": 40, "temperature": 0}
    with Client(server.address, timeout=120) as c:
        whole = c.generate("List three colors:", sampling_params=params)
        chunks = list(c.stream("List three colors:", sampling_params=params))
    assert len(chunks) > 1
    assert "".join(ch.text for ch in chunks) == whole.text
    assert [t for ch in chunks for t in ch.output_ids] == whole.output_ids
    assert [ch.finished for ch in chunks] == [False] * (len(chunks) - 1) + [True]


def test_chat_messages_use_the_template(server, tokenizer):
    messages = [{"role": "user", "content": "Say hello."}]
    expected_prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    n_prompt = len(tokenizer(expected_prompt, add_special_tokens=False).input_ids)
    with Client(server.address, timeout=120) as c:
        out = c.generate(messages=messages, sampling_params={"max_new_tokens": 16})
    assert out.meta_info.prompt_tokens == n_prompt
    assert out.finished


BAD_REQUESTS = [
    (b"\xc1 not msgpack", "MessagePack"),
    (msgspec.msgpack.encode([1, 2, 3]), "object"),
    (msgspec.msgpack.encode({"type": "launch_missiles"}), "type"),
    (
        msgspec.msgpack.encode(
            {"type": "generate", "text": "hi", "sampling_params": {"max_new_tokens": -1}}
        ),
        "max_new_tokens",
    ),
    (msgspec.msgpack.encode({"type": "generate", "text": ""}), "text"),
    (msgspec.msgpack.encode({"type": "generate", "input_ids": []}), "input_ids"),
    (
        msgspec.msgpack.encode(
            {"type": "generate", "text": "hi", "sampling_params": {"temprature": 0}}
        ),
        "temprature",
    ),
    (msgspec.msgpack.encode({"type": "generate", "input_ids": [1, 10**9]}), "input_ids"),
]


@pytest.mark.parametrize("payload, names", BAD_REQUESTS)
def test_invalid_request_gets_an_error_and_the_server_goes_on(server, payload, names):
    reply = raw_round_trip(server.address, payload)
    assert reply["type"] == "error" and reply["code"] == "invalid_request"
    assert names in reply["message"]
    with Client(server.address, timeout=60) as c:
        assert c.generate("Hi", sampling_params={"max_new_tokens": 2}).finished


def test_too_long_prompt_is_refused(server):
    with Client(server.address, timeout=60) as c:
        context = c.model_info().context_length
        with pytest.raises(ServerError) as err:
            c.generate(input_ids=[1] * context, sampling_params={"max_new_tokens": 1})
    assert err.value.code == "too_long"


def test_model_info_and_health(server, tokenizer):
    with Client(server.address, timeout=60) as c:
        info = c.model_info()
        assert c.health().status == "ok"
    # On the wire too, for clients without our structs' defaults.
    health = raw_round_trip(server.address, msgspec.msgpack.encode({"type": "health"}))
    assert health == {"type": "health", "status": "ok"}
    assert info.architecture == "LlamaForCausalLM"
    assert info.dtype == "float32"  # as resolved, not "auto"
    assert info.vocab_size >= len(tokenizer) - 1 and info.context_length == 8192
