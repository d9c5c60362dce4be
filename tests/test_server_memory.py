"""End to end under memory pressure and with long prompts: retraction, chunked prefill and the
radix cache, on the real default model (float32, greedy), compared with solo runs."""

from __future__ import annotations

import asyncio
import random

import pytest

from radixserve.client import AsyncClient, Client
from radixserve.client.local_server import launched_server

GREEDY = {"temperature": 0, "ignore_eos": True}
# Two servers run at once in this module: on a GPU each takes a third of it instead of the
# default 85%, or the second would not fit (on a CPU: their KV pools, a share of the free memory).
GPU_SHARE = ("--mem-fraction-static", "0.3")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


async def _generate_all(address: str, prompts: list[list[int]], max_new: int) -> list:
    async with AsyncClient(address, timeout=600) as c:
        params = {**GREEDY, "max_new_tokens": max_new}
        return await asyncio.gather(
            *(c.generate(input_ids=p, sampling_params=params) for p in prompts)
        )


@pytest.fixture(scope="module")
def solo_server():
    """A roomy server that runs one request at a time: the reference."""
    with launched_server(
        *GPU_SHARE,
        "--dtype",
        "float32",
        "--max-running-requests",
        "1",
        "--disable-radix-cache",
        "--check-invariants",
    ) as s:
        yield s


def _solo(server, prompt: list[int], max_new: int) -> list[int]:
    with Client(server.address, timeout=600) as c:
        out = c.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": max_new})
    return out.output_ids


def test_retraction_and_eviction_under_a_tiny_kv_pool_keep_every_output(solo_server):
    shared = _prompt(40, 99)  # half the prompts share it: the tree holds it under pressure
    prompts = [
        (shared if i % 2 else []) + _prompt(random.Random(i).randrange(30, 60), i)
        for i in range(12)
    ]
    max_new = 32
    with launched_server(
        *GPU_SHARE, "--dtype", "float32", "--max-total-tokens", "640", "--check-invariants"
    ) as s:
        outs = asyncio.run(_generate_all(s.address, prompts, max_new))
        with Client(s.address, timeout=60) as c:
            info = c.server_info()
    assert info.num_retractions > 0 and info.num_evicted_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert out.finished and len(out.output_ids) == max_new
        assert out.output_ids == _solo(solo_server, prompt, max_new)


def test_long_prompt_is_chunked_while_others_decode(solo_server):
    long_prompt, short_prompt = _prompt(700, 1), _prompt(20, 2)
    with launched_server(
        *GPU_SHARE,
        "--dtype",
        "float32",
        "--chunked-prefill-size",
        "128",
        "--disable-radix-cache",
        "--check-invariants",
    ) as s:

        async def run():
            loop = asyncio.get_running_loop()
            async with AsyncClient(s.address, timeout=600) as c:
                short_stamps: list[float] = []

                async def short():
                    params = {**GREEDY, "max_new_tokens": 60}
                    async for _ in c.stream(input_ids=short_prompt, sampling_params=params):
                        short_stamps.append(loop.time())

                async def long():
                    await asyncio.sleep(0.5)  # arrives while the short one decodes
                    sent, first, ids = loop.time(), None, []
                    params = {**GREEDY, "max_new_tokens": 8}
                    async for out in c.stream(input_ids=long_prompt, sampling_params=params):
                        first = first or loop.time()
                        ids += out.output_ids
                    return sent, first, ids

                _, (sent, first, ids) = await asyncio.gather(short(), long())
                return short_stamps, sent, first, ids

        short_stamps, sent, first, ids = asyncio.run(run())
    assert ids == _solo(solo_server, long_prompt, 8)  # chunked equals unchunked
    # 700 tokens in chunks of 128 take 6 steps; the short request decoded in them. Unchunked,
    # one step would prefill it all and at most one short token could land in between.
    assert len([t for t in short_stamps if sent < t < first]) >= 3


def test_shared_prefix_is_served_from_the_cache(solo_server):
    system = _prompt(200, 7)
    a, b = system + _prompt(12, 8), system + _prompt(12, 9)
    params = {**GREEDY, "max_new_tokens": 16}
    with (
        launched_server(*GPU_SHARE, "--dtype", "float32", "--check-invariants") as s,
        Client(s.address, timeout=600) as c,
    ):
        out_a = c.generate(input_ids=a, sampling_params=params)
        out_b = c.generate(input_ids=b, sampling_params=params)
        info = c.server_info()
    assert out_b.meta_info.cached_tokens >= 192
    assert info.cache_hit_rate > 0
    assert out_a.output_ids == _solo(solo_server, a, 16)
    assert out_b.output_ids == _solo(solo_server, b, 16)
