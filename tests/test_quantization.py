"""--quantization int8: w8a8 linear layers through fbgemm, per-token activation scales."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import _one_prompt_batch

from radixserve.model_worker.layers import ColumnParallelLinear, RowParallelLinear
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.quantization import Int8Weight


def test_int8_matmul_is_close_to_float() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=gen)
    x = torch.randn(5, 200, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1.0, 500.0])[:, None]
    bias = torch.randn(96, generator=gen)
    expected = x @ w.T + bias
    got = Int8Weight(w).matmul(x, bias)
    # Each row to within ~2% of its own size, however small or large it is: per-token scales.
    for row in range(5):
        err = (got[row] - expected[row]).norm() / (expected[row] - bias).norm()
        assert err < 0.02, f"row {row}: relative error {err:.4f}"


def test_a_token_is_quantized_on_its_own_range() -> None:
    """With one scale per tensor, an outlier row would coarsen every other row's quantization."""
    gen = torch.Generator().manual_seed(1)
    weight = Int8Weight(torch.randn(64, 128, generator=gen))
    x = torch.rand(1, 128, generator=gen)  # all positive: alone, its tensor range is [0, 1]
    outlier = torch.randn(1, 128, generator=gen) * 1000
    alone = weight.matmul(x, None)
    batched = weight.matmul(torch.cat([outlier, x, outlier]), None)
    assert torch.equal(batched[1], alone[0])


def test_int8_model_quantizes_every_linear_and_the_head(tiny_model) -> None:
    path = str(tiny_model("qwen2", tie_word_embeddings=True))
    runners = {
        q: ModelRunner(
            path,
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_total_tokens=32,
            mem_fraction_static=0.0,
            tp=TPGroup(),
            seed=0,
            quantization=q,
        )
        for q in (None, "int8")
    }
    model = runners["int8"].model
    kinds = ColumnParallelLinear | RowParallelLinear
    linears = [m for m in model.modules() if isinstance(m, kinds)]
    assert linears and all(isinstance(m.weight, Int8Weight) for m in linears)
    assert isinstance(model.lm_head.head_weight, Int8Weight)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the lookup stays float
    logits = {q: r.forward_logits(_one_prompt_batch(6)) for q, r in runners.items()}
    ref, got = logits[None], logits["int8"]
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(got, ref)


def test_unknown_quantization_is_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        ModelRunner(
            str(tiny_model("llama")),
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_total_tokens=32,
            mem_fraction_static=0.0,
            tp=TPGroup(),
            seed=0,
            quantization="fp4",
        )
