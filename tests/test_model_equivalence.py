"""Our model code equals transformers' on the same weights.

Tiny random Llama, Qwen2 and Qwen3 models in float32. Two sequences share each forward: A
prefills, then decodes while B prefills in two chunks (the second on top of a cached prefix),
then both decode. Their KV slots are shuffled and interleaved across the pool. Every row our
runner computes is compared with transformers' logits for the whole sequence so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_sampler import make_info
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.scheduler.seen_tokens import SeenTokens

TOLERANCE = 1e-4
POOL_TOKENS = 200

CASES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2-linear-rope": (
        "qwen2",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
    ),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
}


@dataclass
class Seq:
    tokens: list[int]
    slots: torch.Tensor  # this sequence's KV slots, in token order
    computed: int = 0  # tokens whose KV is in the pool
    rows: list[torch.Tensor] = field(default_factory=list)


def step(runner: ModelRunner, work: list[tuple[Seq, int]]) -> None:
    """One forward over several sequences, each computing its next `n` tokens."""
    prefix = torch.tensor([s.computed for s, _ in work])
    extend = torch.tensor([n for _, n in work])
    seq_lens = prefix + extend
    kv_slots = torch.zeros(len(work), int(seq_lens.max()), dtype=torch.int64)
    for i, (s, _) in enumerate(work):
        kv_slots[i, : seq_lens[i]] = s.slots[: seq_lens[i]]
    batch = ModelWorkerBatch(
        input_ids=torch.tensor([t for s, n in work for t in s.tokens[s.computed : s.computed + n]]),
        positions=torch.cat([torch.arange(s.computed, s.computed + n) for s, n in work]),
        out_cache_loc=torch.cat([s.slots[s.computed : s.computed + n] for s, n in work]),
        prefix_lens=prefix,
        extend_lens=extend,
        kv_slots=kv_slots,
        sampling=make_info(len(work), temperatures=[0.0] * len(work)),
    )
    logits = runner.forward_logits(batch, rows=torch.arange(int(extend.sum())))
    for (s, n), rows in zip(work, logits.split(extend.tolist()), strict=True):
        s.rows.append(rows)
        s.computed += n


def assert_matches_hf(hf: torch.nn.Module, s: Seq) -> None:
    with torch.no_grad():
        expected = hf(torch.tensor([s.tokens[: s.computed]])).logits[0]
    ours = torch.cat(s.rows).cpu()
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff < TOLERANCE, f"max abs difference {diff:.2e}"
    assert expected.abs().max() > 0.5, "logits too small for the comparison to mean anything"


@pytest.mark.parametrize("kernels", ["torch_native", "cpu_extension"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_transformers(tiny_model, device, case: str, kernels: str) -> None:
    if kernels == "cpu_extension" and device.type != "cpu":
        pytest.skip("the CPU extension runs on the CPU")
    kind, overrides = CASES[case]
    assert_serves_as_hf(tiny_model(kind, **overrides), device, kernels)


def test_a_float32_checkpoint_labelled_bfloat16_runs_in_float32(tiny_model, device) -> None:
    """config.json says bfloat16 over float32 tensors (merged checkpoints often do): the
    embedding table was kept in bfloat16 then, its rows ~1e-2 off."""
    path: Path = tiny_model("llama")
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    assert_serves_as_hf(path, device, "torch_native")


def assert_serves_as_hf(path: Path, device: torch.device, kernels: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(
        str(path),
        dtype=torch.float32,
        device=device,
        max_total_tokens=POOL_TOKENS,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels=kernels,
    )
    assert runner.kernels_name == kernels
    assert runner.max_total_tokens == POOL_TOKENS

    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(POOL_TOKENS, generator=gen) + 1  # shuffled, slot 0 never used
    tokens = torch.randint(3, 256, (60,), generator=gen).tolist()
    a = Seq(tokens[:25], slots[0::2])  # A and B interleave across the pool
    b = Seq(tokens[25:], slots[1::2])

    step(runner, [(a, 11)])  # A: prompt
    step(runner, [(b, 6), (a, 1)])  # B: first chunk, A: decode
    step(runner, [(a, 1), (b, 7)])  # A: decode, B: second chunk over a cached prefix
    for _ in range(4):
        step(runner, [(b, 1), (a, 1)])  # both decode, at different lengths
    step(runner, [(a, 3), (b, 1)])  # A: a chunk again, B: decode
    assert_matches_hf(hf, a)
    assert_matches_hf(hf, b)


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.5])
def test_sharded_checkpoint_and_greedy_forward(
    tiny_model, device, repetition_penalty: float
) -> None:
    """Greedy decoding through ModelRunner.forward equals transformers', also with its
    repetition penalty, reading the seen tokens the batch carries. The prompt prefills in two
    chunks: the first one's sample is discarded."""
    path: Path = tiny_model("qwen3", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(
        str(path),
        dtype=torch.float32,
        device=device,
        max_total_tokens=64,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
    )
    prompt = [5, 17, 99, 3, 42, 17, 5]
    penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty)
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = hf(torch.tensor([expected])).logits[:, -1]
            expected.append(int(penalty(torch.tensor([expected]), logits).argmax()))
    s = Seq(list(prompt), torch.arange(64, 0, -1))
    out: list[int] = []
    for end in [4, *range(len(prompt), len(prompt) + 6)]:
        emits = end >= len(prompt)
        batch = ModelWorkerBatch(
            input_ids=torch.tensor(s.tokens[s.computed : end]),
            positions=torch.arange(s.computed, end),
            out_cache_loc=s.slots[s.computed : end],
            prefix_lens=torch.tensor([s.computed]),
            extend_lens=torch.tensor([end - s.computed]),
            kv_slots=s.slots[None, :end],
            sampling=make_info(
                1,
                temperatures=[0.0],
                repetition_penalties=[repetition_penalty],
                output_index=[len(out)],
                seen={0: SeenTokens.of(prompt, out)},  # as the scheduler keeps it
            ),
        )
        token = runner.forward(batch).next_token_ids
        assert token.dtype == torch.int64 and token.device.type == "cpu"
        s.computed = end
        if emits:
            s.tokens.append(int(token[0]))
            out.append(int(token[0]))
    assert out == expected[len(prompt) :]
