"""--quantization int8: w8a8 linear layers, per-token activation scales, exact int32 products
(the CPU extension's int8_linear, its VNNI kernel on its own weight layout, and oneDNN's through
torch._int_mm where it is exact)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_cpu_kernels import _one_prompt_batch, torch_threads

from radixserve.model_worker.cpu_features import has_native_bf16
from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.int8_weight import (
    INT8_GEMM_MIN_ROWS,
    Int8Weight,
    int8_weight_nbytes,
    onednn_int8_is_exact,
    vnni_kernel_available,
    vnni_layout_available,
)
from radixserve.model_worker.layers import ColumnParallelLinear, RowParallelLinear
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup

load_cpu_kernels()  # cached after the first build
ops = torch.ops.radixserve
# The weight layouts this CPU runs: plain rows everywhere, VNNI's blocks where it has AVX512-VNNI
# (AMX CPUs too, though their models keep the plain layout).
needs_vnni = pytest.mark.skipif(not vnni_kernel_available(), reason="no AVX512-VNNI")
LAYOUTS = [pytest.param(False, id="plain"), pytest.param(True, id="vnni", marks=needs_vnni)]


def exact_reference(
    x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b from int64 products of the quantized values, rescaled as every kernel does."""
    xq, x_scale = ops.quantize_rows_int8(x.contiguous())
    products = (xq.long() @ q.long().T).int()
    return ops.dequantize_rows(products, x_scale, w_scale, bias)


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


def test_activations_round_to_nearest_even_on_each_rows_own_scale() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 200, generator=gen) * torch.tensor([1e-3, 1.0, 50.0, 1.0, 0.0, 7.0])[:, None]
    x[3, :5] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5])  # row 3: scale 1, so these are ties
    q, scale = ops.quantize_rows_int8(x)
    expected_scale = x.abs().amax(dim=1) / 127
    assert torch.equal(scale, expected_scale)
    inverse = torch.where(expected_scale > 0, 1 / expected_scale, 0)
    assert torch.equal(q, torch.round(x * inverse[:, None]).to(torch.int8))
    assert q[3, :5].tolist() == [127, 0, 0, 2, -2]
    assert not q[4].any()  # an all-zero row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_quantize_per_row_as_the_torch_reference(dtype) -> None:
    """The weights' quantizer against the torch ops it replaced: max |w| / 127, round half to
    even, [-127, 127]; a zero or subnormal row zero with scale 0."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 203, generator=gen) * torch.logspace(-30, 30, 40)[:, None]
    rows[3] = 0
    rows[4] = 1e-40  # subnormal: its scale would be too
    rows[5, :6] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, -127.0])  # scale 1: ties
    rows[5, 6:] = 0
    rows = rows.to(dtype)
    weight = Int8Weight(rows)
    q = weight.int8_rows()
    ref = rows.float()
    scale = ref.abs().amax(dim=1) / 127
    normal = scale >= torch.finfo(torch.float32).tiny
    inverse = torch.where(normal, 1 / scale, 0)
    expected = torch.round(ref * inverse[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(q, expected)
    assert torch.equal(weight.scale, torch.where(normal, scale, 0))
    assert q[5, :6].tolist() == [127, 0, 0, 2, -2, -127]
    assert not q[3].any() and not q[4].any() and weight.scale[4] == 0


@pytest.mark.parametrize("vnni", LAYOUTS)
def test_int8_products_are_exact_at_the_extremes(vnni: bool) -> None:
    """127 * 127 pairs overflow a 16-bit pair sum (where AVX2 saturates) unless the kernel
    keeps them below 2^15: the sums must come out exact, and all paths agree bit for bit."""
    gen = torch.Generator().manual_seed(3)
    K = 1536
    signs = torch.randint(0, 2, (3, 16, K), generator=gen) * 2 - 1
    x = (signs[0] * 127).float()  # rows of +-127: each row's scale is exactly 1
    weight = Int8Weight.from_int8(signs[1] * 127, torch.ones(16), vnni=vnni)
    expected = (x.long() @ (signs[1] * 127).T).float()
    for rows in (1, 8, 16):
        assert torch.equal(weight.matmul(x[:rows], None), expected[:rows])
    if onednn_int8_is_exact():
        assert INT8_GEMM_MIN_ROWS <= 16  # the 16 rows above went through oneDNN (plain)


@pytest.mark.parametrize("vnni", LAYOUTS)
def test_a_weight_of_minus_128_keeps_its_sign(vnni: bool) -> None:
    """Pre-quantized checkpoints use -128, which AVX2's sign trick once negated to itself:
    every path gives the exact products of any int8 weight; weights quantized here stay in
    [-127, 127]."""
    gen = torch.Generator().manual_seed(5)
    K = 96
    x = (torch.randint(0, 2, (16, K), generator=gen) * 2 - 1).float() * 127  # scale exactly 1
    q = torch.full((4, K), -128, dtype=torch.int8)
    q[1, ::2] = 127
    weight = Int8Weight.from_int8(q, torch.ones(4), vnni=vnni)
    assert torch.equal(weight.int8_rows(), q)
    expected = (x.long() @ q.long().T).float()
    for rows in (1, 3, 8, 16):
        assert torch.equal(weight.matmul(x[:rows], None), expected[:rows])
    quantized = Int8Weight(torch.randn(8, K, generator=gen), vnni=vnni).int8_rows()
    assert quantized.min() >= -127 and quantized.max() <= 127


@pytest.mark.parametrize("vnni", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_or_infinity_makes_its_row_or_channel_nan(vnni: bool, dtype: torch.dtype) -> None:
    """A token with a NaN or an infinity has no int8 scale: its outputs are NaN, as a float
    matmul's are (not the bias alone, as if it were zeros), wherever the value lies in the row
    (in the SIMD part or the tail); a weight channel with one is NaN for every token. The other
    rows and channels are what they are without them."""
    gen = torch.Generator().manual_seed(11)
    K = 37  # 32 in vectors of 8 or 16 lanes, 5 in the scalar tail
    w = torch.randn(70, K, generator=gen)
    bias = torch.randn(70, generator=gen)
    weight = Int8Weight(w, vnni=vnni)
    for rows in (3, 12):  # int8_linear, and int8_gemm where oneDNN's sums are exact
        clean = torch.randn(rows, K, generator=gen)
        expected = weight.matmul(clean.to(dtype), bias)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for at in (0, K - 1):
                x = clean.clone()
                x[1, at] = bad
                y = weight.matmul(x.to(dtype), bias)
                assert y[1].isnan().all(), (bad, at, rows)
                assert torch.equal(y[[0, 2]], expected[[0, 2]])
    w[5, 0] = float("nan")
    w[6, K - 1] = float("nan")
    w[7, 3] = float("inf")
    weight = Int8Weight(w, vnni=vnni)
    y = weight.matmul(torch.randn(4, K, generator=gen).to(dtype), None)
    assert y[:, 5:8].isnan().all()
    assert torch.isfinite(y[:, :5]).all() and torch.isfinite(y[:, 8:]).all()


@pytest.mark.parametrize("K", [37, 64, 203])
def test_bfloat16_rows_quantize_as_their_float32_values(K: int) -> None:
    """bfloat16 rows take their max |x| from the values' bits (quantize_row.h): the same int8
    values and scales as the same numbers in float32, with the largest magnitude negative, in the
    tail past whole vectors, a NaN with its sign bit set, infinities, and subnormal rows."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(8, K, generator=gen) * torch.logspace(-38, 30, 8)[:, None]
    x[0, K - 1] = -1e4  # the largest magnitude, negative, in the tail
    x[2, 3] = -float("inf")
    x[3] = 1e-39  # subnormal in both dtypes: scale 0
    x = x.bfloat16()
    # A NaN with its sign bit set (0xffc0), written as bits: torch's own conversion of -nan keeps
    # the sign with its AVX2/AVX-512 kernels and drops it with its scalar ones.
    x.view(torch.int16)[1, K // 2] = -64
    assert x[1, K // 2].isnan()
    q16, scale16 = ops.quantize_rows_int8(x)
    q32, scale32 = ops.quantize_rows_int8(x.float())
    assert torch.equal(q16, q32)
    torch.testing.assert_close(scale16, scale32, rtol=0, atol=0, equal_nan=True)
    assert scale16[1:3].isnan().all() and scale16[3] == 0 and q16[0, K - 1] == -127


def test_a_subnormal_channel_scale_quantizes_to_zeros_not_infinities() -> None:
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    w[1] = 1e-40  # subnormal: 1 / (1e-40 / 127) is infinite in float32
    w[2] = 0.0
    weight = Int8Weight(w)
    q = weight.int8_rows()
    assert weight.scale[1] == 0 and weight.scale[2] == 0 and not q[1:].any()
    assert torch.isfinite(weight.scale).all() and q[0].abs().max() == 127
    y = weight.matmul(torch.randn(2, 64), None)
    assert torch.isfinite(y).all() and not y[:, 1:].any()


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = Int8Weight(torch.randn(300, 128, generator=gen))
    bias = torch.randn(300, generator=gen)
    x = torch.randn(40, 128, generator=gen)
    batched = weight.matmul(x, bias)
    for row in (0, 17, 39):
        assert torch.equal(weight.matmul(x[row : row + 1], bias)[0], batched[row])


@pytest.mark.skipif(
    not onednn_int8_is_exact(),
    reason="int8_gemm runs only where oneDNN's int8 sums are exact (VNNI, AMX): int8_small_rows",
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_rescales_block_by_block_as_one_rescale_of_the_whole(with_bias) -> None:
    """int8_gemm multiplies and rescales a block of outputs at a time (16 MB of int32 products:
    13,981 outputs of 300 rows): the blocks, the last one short, and the vectorised rescale
    give the separate ops' result bit for bit, bias or not, on rows of any stride."""
    gen = torch.Generator().manual_seed(7)
    N, K = 40_000, 72  # K not a multiple of the SIMD width, N beyond one block
    weight = Int8Weight(torch.randn(N, K, generator=gen), vnni=False)
    bias = torch.randn(N, generator=gen) if with_bias else None
    x = torch.randn(300, 2 * K, generator=gen)[:, :K]  # rows 2K apart: not contiguous
    xq, x_scale = ops.quantize_rows_int8(x.contiguous())
    products = (xq.long() @ weight.q.long().T).int()  # exact: |sums| < 72 * 127 * 127
    expected = ops.dequantize_rows(products, x_scale, weight.scale, bias)
    for rows in (300, 105, 9, 1):
        assert torch.equal(ops.int8_gemm(x[:rows], weight.q, weight.scale, bias), expected[:rows])
    assert ops.int8_gemm(x[:0], weight.q, weight.scale, bias).shape == (0, N)


@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 13), (100, 70), (130, 261)])
def test_the_vnni_kernel_is_exact_at_odd_shapes(n: int, k: int) -> None:
    """Channels not a multiple of the block (64) or vector (16), K not a multiple of the group
    (4) or the vector (64), every row count of 1 to 70 (tiles of 6 rows and every remainder) on 1,
    2 and 3 threads, rows of any stride, bias or not: the exact int32 products, rescaled bit for
    bit as the other paths do, and as int8_linear on the plain weight; bfloat16 rows likewise."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(n, generator=gen)
    weight = Int8Weight.from_int8(q, w_scale, vnni=True)
    assert torch.equal(weight.int8_rows(), q)
    x = torch.randn(70, 2 * k, generator=gen)[:, :k] * 3  # rows 2K apart: not contiguous
    for bias in (None, torch.randn(n, generator=gen)):
        expected = exact_reference(x, q, w_scale, bias)
        # 2 or 3 threads: a thread's tiles may start inside a block. Every result is kept until
        # compared, so that none is written into a freed one that held the same values.
        results = {}
        for rows, threads in itertools.product(range(1, 71), (1, 2, 3)):
            with torch_threads(threads):
                results[rows, threads] = weight.matmul(x[:rows], bias)
        for (rows, threads), got in results.items():
            assert torch.equal(got, expected[:rows]), (rows, threads)
        assert torch.equal(ops.int8_linear(x[:5], q, w_scale, bias), expected[:5])
        # bfloat16 rows (a bfloat16 model's): the float32 result of their exact values, rounded
        # once, on every path.
        x16 = x.bfloat16()
        expected16 = exact_reference(x16.float(), q, w_scale, bias).bfloat16()
        for rows in (1, 6, 7, 70):
            assert torch.equal(weight.matmul(x16[:rows], bias), expected16[:rows]), rows
        for path in (ops.int8_linear, ops.int8_gemm):
            assert torch.equal(path(x16[:9].contiguous(), q, w_scale, bias), expected16[:9])
    assert weight.matmul(x[:0], None).shape == (0, n)


@needs_vnni
@pytest.mark.parametrize(
    ("intermediate", "k", "threads"), [(64, 13, 2), (128, 70, 2), (100, 70, 2), (320, 70, 1)]
)
def test_the_vnni_swiglu_is_silu_and_mul_of_the_exact_products(
    intermediate: int, k: int, threads: int
) -> None:
    """int8_vnni_linear_silu_and_mul on a [gate | up] weight: silu_and_mul of the exact products,
    in float32 to the bit; in bfloat16 rounded once, gate and up kept in float32 (an intermediate
    size of 64's multiples, whose blocks pair), or as the two ops give it (100: they do not).
    Up to 512 rows a thread takes its blocks in runs (one thread's five blocks: runs of 3 + 2 at
    300 rows, 2 + 2 + 1 at 512); from 513 on, a tile of rows at a time."""
    gen = torch.Generator().manual_seed(10)
    n = 2 * intermediate
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(n, generator=gen) / 50
    weight = Int8Weight.from_int8(q, w_scale, vnni=True)
    x = torch.randn(600, k, generator=gen) * 3
    with torch_threads(threads):
        for bias in (None, torch.randn(n, generator=gen)):
            expected = ops.silu_and_mul(exact_reference(x, q, w_scale, bias))
            for rows in (1, 5, 6, 7, 13, 70, 300, 512, 513, 600):
                got = ops.int8_vnni_linear_silu_and_mul(x[:rows], weight.q, weight.scale, bias)
                assert torch.equal(got, expected[:rows]), rows
            x16 = x.bfloat16()
            bias16 = None if bias is None else bias.bfloat16()
            if intermediate % 64 == 0:
                bias32 = None if bias16 is None else bias16.float()
                expected16 = ops.silu_and_mul(exact_reference(x16.float(), q, w_scale, bias32))
                expected16 = expected16.bfloat16()
            else:
                expected16 = ops.silu_and_mul(weight.matmul(x16, bias16))
            for rows in (1, 5, 70, 512, 513):
                got16 = ops.int8_vnni_linear_silu_and_mul(
                    x16[:rows], weight.q, weight.scale, bias16
                )
                assert got16.dtype == torch.bfloat16, rows
                assert torch.equal(got16, expected16[:rows]), rows
    assert ops.int8_vnni_linear_silu_and_mul(x[:0], weight.q, weight.scale, None).shape == (
        0,
        intermediate,
    )


@pytest.mark.parametrize("vnni", LAYOUTS)
def test_the_loader_fills_one_copy_in_pieces(vnni: bool) -> None:
    """As the loader writes a fused weight (pieces of rows, starting anywhere in a block of the
    layout): the same weight as quantized whole, in one tensor of the planned size."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(300, 93, generator=gen)
    whole = Int8Weight(w, vnni=vnni)
    pieces = Int8Weight.empty(300, 93, torch.device("cpu"), vnni=vnni)
    for start, end in ((0, 37), (37, 64), (64, 200), (200, 300)):
        pieces.quantize_rows(start, w[start:end])
    assert torch.equal(pieces.q, whole.q) and torch.equal(pieces.scale, whole.scale)
    assert torch.equal(pieces.int8_rows(), Int8Weight(w, vnni=False).q)
    assert pieces.tensors() == (pieces.q, pieces.scale)
    assert pieces.nbytes == pieces.q.nbytes + pieces.scale.nbytes
    if vnni == vnni_layout_available():  # the layout the model's memory plan counts
        assert pieces.nbytes == int8_weight_nbytes(300, 93)
    x = torch.randn(9, 93, generator=gen)
    expected = exact_reference(x, pieces.int8_rows(), whole.scale, None)
    assert torch.equal(pieces.matmul(x, None), expected)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(not has_native_bf16(), reason="no bfloat16 in hardware"),
        ),
    ],
)
def test_int8_model_quantizes_every_linear_and_the_head(tiny_model, dtype) -> None:
    """int8 weights under float32 or bfloat16 activations (the model's dtype)."""
    path = str(tiny_model("qwen2", tie_word_embeddings=True))
    runners = {
        q: ModelRunner(
            path,
            dtype=dtype,
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
    assert isinstance(model.lm_head.weight, Int8Weight)
    assert model.model.embed_tokens.weight.dtype == dtype  # the lookup stays float
    logits = {q: r.forward_logits(_one_prompt_batch(6)).float() for q, r in runners.items()}
    ref, got = logits[None], logits["int8"]
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(got, ref)


@pytest.mark.parametrize(
    ("quantization", "dtype", "reason"),
    [
        ("fp4", torch.float32, "unknown quantization 'fp4'"),
        ("int8", torch.float16, "int8 runs with --dtype float32 or bfloat16"),
    ],
)
def test_quantization_that_cannot_run_is_refused(tiny_model, quantization, dtype, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        ModelRunner(
            str(tiny_model("llama")),
            dtype=dtype,
            device=torch.device("cpu"),
            max_total_tokens=32,
            mem_fraction_static=0.0,
            tp=TPGroup(),
            seed=0,
            quantization=quantization,
        )
