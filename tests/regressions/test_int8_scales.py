"""Issue 22, "a subnormal per-channel scale makes 1/scale infinite": a channel whose weights are
all subnormal must quantize to zeros with a zero scale, and multiply to zeros."""

from __future__ import annotations

import torch

from radixserve.model_worker.quantization import Int8Weight


def test_a_subnormal_channel_scale_gives_zeros_not_garbage() -> None:
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    w[1] = 1e-40  # subnormal: 1 / (1e-40 / 127) is infinite in float32
    weight = Int8Weight(w)
    y = weight.matmul(torch.randn(2, 64, generator=torch.Generator().manual_seed(7)), None)
    assert torch.isfinite(y).all() and not y[:, 1].any(), (
        f"a subnormal channel scale ({weight.scale[1].item():g}) was inverted to infinity: "
        f"its weights became {weight.q[1, :4].tolist()}..., its products {y[:, 1].tolist()}"
    )
