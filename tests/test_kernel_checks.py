"""The CPU extension's ops refuse shapes and lengths that disagree with a clean error (a
RuntimeError naming the op), where they once read or wrote out of bounds (SIGSEGV), divided by
zero KV heads (SIGFPE) or left rows uninitialised. The checks are O(batch): lengths and shapes,
and the new tokens' slots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixserve.model_worker.cpu_kernels import load_cpu_kernels


@pytest.fixture(scope="module")
def ops() -> Any:
    load_cpu_kernels()
    return torch.ops.radixserve


def attention_args(**changes: Any) -> dict[str, Any]:
    """A valid call: two sequences (prefix 3 + 1 new token, 0 + 2 new), 4 query heads over 2 KV
    heads of size 16, a pool of 32 slots; `changes` replaces some of it."""
    tokens, heads, kv_heads, dim, pool = 3, 4, 2, 16, 32
    args = {
        "q": torch.randn(tokens, heads, dim),
        "k": torch.randn(tokens, kv_heads, dim),
        "v": torch.randn(tokens, kv_heads, dim),
        "k_cache": torch.zeros(pool, kv_heads, dim),
        "v_cache": torch.zeros(pool, kv_heads, dim),
        "out_cache_loc": torch.tensor([10, 11, 12]),
        "kv_slots": torch.tensor([[0, 1, 2, 10], [11, 12, 0, 0]]),
        "prefix_lens": torch.tensor([3, 0]),
        "extend_lens": torch.tensor([1, 2]),
        "scale": 0.25,
    }
    return args | changes


def test_paged_attention_runs_on_the_valid_call(ops) -> None:
    out = ops.paged_attention(**attention_args())
    assert out.shape == (3, 4, 16) and torch.isfinite(out).all()


BAD_ATTENTION: dict[str, dict[str, Any]] = {
    "zero KV heads": {
        "k": torch.randn(3, 0, 16),
        "v": torch.randn(3, 0, 16),
        "k_cache": torch.zeros(32, 0, 16),
        "v_cache": torch.zeros(32, 0, 16),
    },
    "query heads not a multiple": {"q": torch.randn(3, 3, 16)},
    "k of other tokens": {"k": torch.randn(2, 2, 16)},
    "v shorter than k": {"v": torch.randn(3, 1, 16)},
    "v_cache smaller": {"v_cache": torch.zeros(8, 2, 16)},
    "head size of the cache": {"k_cache": torch.zeros(32, 2, 8)},
    "a slot per token missing": {"out_cache_loc": torch.tensor([10, 11])},
    "a slot past the pool": {"out_cache_loc": torch.tensor([10, 11, 32])},
    "a negative slot": {"out_cache_loc": torch.tensor([10, -1, 12])},
    "extend past the slots row": {"prefix_lens": torch.tensor([3, 3])},
    "negative prefix": {"prefix_lens": torch.tensor([-1, 0])},
    "extends not summing to the tokens": {"extend_lens": torch.tensor([1, 1])},
    "a length per sequence missing": {"prefix_lens": torch.tensor([3])},
    "slots rows per sequence": {"kv_slots": torch.tensor([[0, 1, 2, 10]])},
    "slots not 2-D": {"kv_slots": torch.tensor([0, 1, 2, 10])},
}


@pytest.mark.parametrize("changes", BAD_ATTENTION.values(), ids=BAD_ATTENTION.keys())
def test_paged_attention_refuses_what_disagrees(ops, changes) -> None:
    with pytest.raises(RuntimeError, match="paged_attention"):
        ops.paged_attention(**attention_args(**changes))


def _bad_small_ops(ops: Any) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    x, w = torch.randn(4, 8), torch.randn(8)
    return {
        "rms_norm: weight short": (ops.rms_norm, (x, torch.randn(7), 1e-6)),
        "rms_norm: weight 2-D": (ops.rms_norm, (x, torch.randn(1, 8), 1e-6)),
        "fused_add_rms_norm: weight short": (
            ops.fused_add_rms_norm,
            (x.clone(), x.clone(), torch.randn(4), 1e-6),
        ),
        "fused_add_rms_norm: residual of other rows": (
            ops.fused_add_rms_norm,
            (x.clone(), torch.randn(3, 8), w, 1e-6),
        ),
        "rotary_embedding: k of other tokens": (
            ops.rotary_embedding,
            (torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(4, 4), torch.randn(4, 4)),
        ),
        "rotary_embedding: k of another head size": (
            ops.rotary_embedding,
            (torch.randn(4, 2, 8), torch.randn(4, 2, 4), torch.randn(4, 4), torch.randn(4, 4)),
        ),
        "rotary_embedding: sin shorter": (
            ops.rotary_embedding,
            (torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 4), torch.randn(2, 4)),
        ),
        "rotary_embedding: cos of other tokens": (
            ops.rotary_embedding,
            (torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(5, 4), torch.randn(5, 4)),
        ),
        "silu_and_mul: odd width": (ops.silu_and_mul, (torch.randn(4, 7),)),
        "linear_small_m: weight of another K": (ops.linear_small_m, (x, torch.randn(3, 7), None)),
        "linear_small_m: weight 1-D": (ops.linear_small_m, (x, torch.randn(8), None)),
        "linear_small_m: bias short": (ops.linear_small_m, (x, torch.randn(3, 8), torch.randn(2))),
        "int8_linear: scales short": (
            ops.int8_linear,
            (x, torch.ones(3, 8, dtype=torch.int8), torch.ones(2), None),
        ),
        "int8_linear: weight of another K": (
            ops.int8_linear,
            (x, torch.ones(3, 9, dtype=torch.int8), torch.ones(3), None),
        ),
        "int8_linear: float16 rows": (
            ops.int8_linear,
            (x.half(), torch.ones(3, 8, dtype=torch.int8), torch.ones(3), None),
        ),
        "int8_gemm: scales short": (
            ops.int8_gemm,
            (x, torch.ones(3, 8, dtype=torch.int8), torch.ones(2), None),
        ),
        "int8_gemm: weight of another K": (
            ops.int8_gemm,
            (x, torch.ones(3, 9, dtype=torch.int8), torch.ones(3), None),
        ),
        "int8_gemm: bias short": (
            ops.int8_gemm,
            (x, torch.ones(3, 8, dtype=torch.int8), torch.ones(3), torch.ones(2)),
        ),
        "int8_vnni_linear: weight of another K": (
            ops.int8_vnni_linear,
            (x, torch.ones(1, 3, 64, 4, dtype=torch.uint8), torch.ones(3), None),
        ),
        "int8_vnni_linear: scales for another layout": (
            ops.int8_vnni_linear,
            (x, torch.ones(1, 2, 64, 4, dtype=torch.uint8), torch.ones(65), None),
        ),
        "int8_vnni_linear_silu_and_mul: outputs not a gate/up pair": (
            ops.int8_vnni_linear_silu_and_mul,
            (x, torch.ones(1, 2, 64, 4, dtype=torch.uint8), torch.ones(3), None),
        ),
        "int8_vnni_linear_silu_and_mul: scales for another layout": (
            ops.int8_vnni_linear_silu_and_mul,
            (x, torch.ones(1, 2, 64, 4, dtype=torch.uint8), torch.ones(256), None),
        ),
        "int8_vnni_pack: rows past the layout": (
            ops.int8_vnni_pack,
            (torch.ones(1, 2, 64, 4, dtype=torch.uint8), 60, torch.ones(8, 8, dtype=torch.int8)),
        ),
        "dequantize_rows: scales short": (
            ops.dequantize_rows,
            (torch.ones(4, 3, dtype=torch.int32), torch.ones(3), torch.ones(3), None),
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "rms_norm: weight short",
        "rms_norm: weight 2-D",
        "fused_add_rms_norm: weight short",
        "fused_add_rms_norm: residual of other rows",
        "rotary_embedding: k of other tokens",
        "rotary_embedding: k of another head size",
        "rotary_embedding: sin shorter",
        "rotary_embedding: cos of other tokens",
        "silu_and_mul: odd width",
        "linear_small_m: weight of another K",
        "linear_small_m: weight 1-D",
        "linear_small_m: bias short",
        "int8_linear: scales short",
        "int8_linear: weight of another K",
        "int8_gemm: scales short",
        "int8_gemm: weight of another K",
        "int8_gemm: bias short",
        "int8_vnni_linear: weight of another K",
        "int8_vnni_linear: scales for another layout",
        "int8_vnni_linear_silu_and_mul: outputs not a gate/up pair",
        "int8_vnni_linear_silu_and_mul: scales for another layout",
        "int8_vnni_pack: rows past the layout",
        "dequantize_rows: scales short",
    ],
)
def test_the_small_ops_refuse_what_disagrees(ops, case: str) -> None:
    op, args = _bad_small_ops(ops)[case]
    with pytest.raises(RuntimeError, match=case.split(":")[0]):
        op(*args)
