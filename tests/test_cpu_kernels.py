"""The CPU extension (model_worker/csrc) against the torch reference it replaces: paged attention
against the torch_native backend on a mixed batch, each fused op against TorchOps, in float32 and
(where the CPU has it in hardware) bfloat16, and proof from the profiler that a forward with
`--kernels cpu_extension` runs the extension's ops and no SDPA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import pytest
import torch
from test_attention import make_batch, run_backend

from radixserve.model_worker.cpu_features import has_amx_bf16, has_avx512_bf16, has_native_bf16
from radixserve.model_worker.fused_ops import (
    SMALL_M,
    CpuKernelOps,
    TorchOps,
    small_kernel_rows,
)
from radixserve.model_worker.kernel_selection import select_kernels
from radixserve.model_worker.kv_pool import TokenToKVPool
from radixserve.model_worker.layers import ColumnParallelLinear
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.packed_linear import PackedWeight, find_panels
from radixserve.model_worker.parallel import TPGroup

CPU = torch.device("cpu")
BF16 = torch.bfloat16
needs_native_bf16 = pytest.mark.skipif(
    not has_native_bf16(), reason="cpu_extension runs bfloat16 only on CPUs with AVX512-BF16 or AMX"
)
# The kernels compute in float32 and round once; torch rounds after each eager op: a few bf16
# steps (2^-8 relative) apart.
close_in_bf16 = partial(torch.testing.assert_close, atol=2e-2, rtol=2e-2)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kernel_ops() -> CpuKernelOps:
    select_kernels("cpu_extension", 4, 2, CPU, torch.float32)  # builds the extension (cached)
    return CpuKernelOps()


MIXED_BATCH = [(150, 1), (0, 70), (5, 1), (200, 33), (64, 1), (130, 64), (0, 1), (97, 1)]


# Many work items: each takes all KV heads of its query rows; few: one KV head each.
def zero_unwritten_slots(pool: TokenToKVPool) -> None:
    """A pool's pages are not written until used: zeroed, two pools compare whole."""
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.zero_()


@pytest.mark.parametrize("lens", [MIXED_BATCH, [(150, 1)], [(0, 70)]], ids=["mixed", "one", "few"])
# The kernel is compiled for head sizes 64 and 128; others take its general loop.
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_paged_attention_equals_torch_native(kernel_ops, lens, head_dim) -> None:
    """SmolLM2's heads (9 query, 3 KV); contexts long enough for several key blocks and query
    blocks per sequence; decodes, a fresh prefill, chunks over cached prefixes, and a prefix hit
    whose one new token is not a decode of a running request."""
    heads, kv_heads, num_slots = 9, 3, 2048
    outs, pools = [], []
    for name in ("torch_native", "cpu_extension"):
        pool = TokenToKVPool(num_slots, 1, kv_heads, head_dim, dtype=torch.float32, device=CPU)
        zero_unwritten_slots(pool)
        case = make_batch(pool, lens, heads, torch.Generator().manual_seed(1))
        outs.append(run_backend(name, case))
        pools.append(pool)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pools[1].k_buffers[0], pools[0].k_buffers[0])
    assert torch.equal(pools[1].v_buffers[0], pools[0].v_buffers[0])


@needs_native_bf16
# 64 and 128: vdpbf16ps on whole 16-pair transposes; 48: 24 pairs, the last 8 packed one by one;
# 33 (odd, no pairs): the keys widened to float32, the pack CPUs without AVX512-BF16 would take.
@pytest.mark.parametrize("head_dim", [64, 128, 48, 33])
def test_paged_attention_in_bfloat16_is_close_to_torch_native(kernel_ops, head_dim) -> None:
    heads, kv_heads = 9, 3
    outs, pools = [], []
    for name in ("torch_native", "cpu_extension"):
        pool = TokenToKVPool(2048, 1, kv_heads, head_dim, dtype=BF16, device=CPU)
        zero_unwritten_slots(pool)
        case = make_batch(pool, MIXED_BATCH, heads, torch.Generator().manual_seed(1))
        attn = select_kernels(name, heads, kv_heads, CPU, BF16).attn_backend
        attn.init_forward_metadata(case.fb)
        outs.append(attn.forward(case.q.to(BF16), case.k.to(BF16), case.v.to(BF16), 0, case.fb))
        pools.append(pool)
    assert outs[1].dtype == BF16
    close_in_bf16(outs[1], outs[0])
    assert torch.equal(pools[1].k_buffers[0], pools[0].k_buffers[0])
    assert torch.equal(pools[1].v_buffers[0], pools[0].v_buffers[0])


@needs_native_bf16
# 64 and 128: compiled in; 80 and 40: the general loop, P x V ending on 16 lanes and on 8 singly;
# 16: no whole 32 elements of P x V pairs.
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40, 16])
# 6 work items: one thread takes every KV head of an item at once (6 units: a thread takes its
# next unit as it starts one), two threads one head each (12), four too (12 < 4 x 4: one unit at
# a time).
@pytest.mark.parametrize("threads", [1, 2, 4])
# A decode's rows: 4 query heads a KV head (row groups of 4, and of 8 in the chunk), 7 (as the
# 0.5B: 7, and 8 + 8 + 5 in the chunk), 2.
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (7, 1), (6, 3)])
def test_paged_attention_in_bfloat16_is_within_its_roundings(
    kernel_ops, head_dim, threads, heads, kv_heads
) -> None:
    """Against float64 on the same bfloat16 values: within the output's rounding and the
    probabilities' (2^-8 each, with room for float32's sums: a kernel may round P to bfloat16
    for P x V, as FlashAttention does), much tighter than close_in_bf16, so that a value paired
    with the wrong key's probability shows. Decodes at odd and even context lengths and a
    prefill chunk (its rows over several groups)."""
    lens = [(150, 1), (33, 1), (0, 1), (64, 1), (100, 21)]
    gen = torch.Generator().manual_seed(head_dim)
    slots_needed = sum(p + e for p, e in lens)
    k_cache = torch.randn(slots_needed, kv_heads, head_dim, generator=gen).to(BF16)
    v_cache = torch.randn(slots_needed, kv_heads, head_dim, generator=gen).to(BF16)
    order = torch.randperm(slots_needed, generator=gen)
    width = max(p + e for p, e in lens)
    kv_slots = torch.zeros(len(lens), width, dtype=torch.long)
    start = 0
    for b, (p, e) in enumerate(lens):
        kv_slots[b, : p + e] = order[start : start + p + e]
        start += p + e
    tokens = sum(e for _, e in lens)
    q = (2 * torch.randn(tokens, heads, head_dim, generator=gen)).to(BF16)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(BF16)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(BF16)
    new_slots = torch.cat([kv_slots[b, p : p + e] for b, (p, e) in enumerate(lens)])
    with torch_threads(threads):
        out = torch.ops.radixserve.paged_attention(
            q, k, v, k_cache, v_cache, new_slots, kv_slots,
            torch.tensor([p for p, _ in lens]), torch.tensor([e for _, e in lens]), head_dim**-0.5,
        ).double()  # fmt: skip
    group = heads // kv_heads
    row = 0
    for b, (p, e) in enumerate(lens):
        seq_slots = kv_slots[b, : p + e]
        keys, values = k_cache[seq_slots].double(), v_cache[seq_slots].double()
        for i in range(e):
            seen = p + i + 1  # causal
            for h in range(heads):
                kv = h // group
                scores = keys[:seen, kv] @ q[row + i, h].double() * head_dim**-0.5
                probs = scores.softmax(-1)
                exact = probs @ values[:seen, kv]
                rounding = exact.abs() + probs @ values[:seen, kv].abs()
                bound = rounding * 2.0**-8 * (1 + 2.0**-6) + 1e-5
                assert ((out[row + i, h] - exact).abs() <= bound).all(), (b, i, h)
        row += e


def test_paged_attention_decodes_more_query_heads_than_a_row_group(kernel_ops) -> None:
    """14 query heads on one KV head: a decode's 14 rows take a group of 8 and one of 6, in
    blocks of 32 keys (past 64 elements a head); head size 80 ends P x V on one vector of 16
    lanes (AVX-512) after two pairs."""
    pool = TokenToKVPool(512, 1, 1, 80, dtype=torch.float32, device=CPU)
    zero_unwritten_slots(pool)
    lens = [(150, 1), (31, 1), (0, 1), (40, 3)]
    case = make_batch(pool, lens, 14, torch.Generator().manual_seed(2))
    out = run_backend("cpu_extension", case)
    torch.testing.assert_close(out, run_backend("torch_native", case), atol=1e-5, rtol=1e-5)


def test_cpu_extension_in_bfloat16_needs_it_in_hardware() -> None:
    if has_native_bf16():
        assert select_kernels("auto", 4, 2, CPU, BF16).name == "cpu_extension"
    else:
        assert select_kernels("auto", 4, 2, CPU, BF16).name == "torch_native"
        with pytest.raises(ValueError, match="no bfloat16 in hardware"):
            select_kernels("cpu_extension", 4, 2, CPU, BF16)
    assert select_kernels("auto", 4, 2, CPU, torch.float16).name == "torch_native"


def test_paged_attention_rejects_slots_outside_the_pool(kernel_ops) -> None:
    pool = TokenToKVPool(64, 1, 2, 16, dtype=torch.float32, device=CPU)
    case = make_batch(pool, [(3, 1)], 4, torch.Generator().manual_seed(0))
    case.fb.kv_slots[0, 0] = 64
    attn = select_kernels("cpu_extension", 4, 2, CPU, torch.float32).attn_backend
    with pytest.raises(IndexError, match="kv_slots"):
        attn.init_forward_metadata(case.fb)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 33])
def test_fused_ops_equal_torch(kernel_ops, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    ref = TorchOps()
    hidden = 100  # not a multiple of the vector width: the tails run too
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(kernel_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))

    res_a = torch.randn(rows, hidden, generator=gen)
    res_b = res_a.clone()
    out_ref = ref.add_rms_norm(x.clone(), res_a, w, 1e-6)
    out = kernel_ops.add_rms_norm(x.clone(), res_b, w, 1e-6)
    torch.testing.assert_close(res_b, res_a)
    torch.testing.assert_close(out, out_ref)

    # q and k as views into one fused projection, as the model makes them; per-head norm on them
    qkv = torch.randn(rows, (6 + 2 + 2) * 16, generator=gen)
    q, k, _ = qkv.split((96, 32, 32), dim=-1)
    q, k = q.view(rows, 6, 16), k.view(rows, 2, 16)
    wh = torch.randn(16, generator=gen)
    torch.testing.assert_close(kernel_ops.rms_norm(q, wh, 1e-6), ref.rms_norm(q, wh, 1e-6))
    angles = torch.randn(rows, 8, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    expected = ref.rotary(q.clone(), k.clone(), cos, sin)
    got = kernel_ops.rotary(q, k, cos, sin)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])

    gate_up = torch.randn(rows, 2 * 50, generator=gen)
    torch.testing.assert_close(kernel_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))

    weight = torch.randn(37, hidden, generator=gen)
    bias = torch.randn(37, generator=gen)
    packed = PackedWeight(weight)
    for b in (None, bias):
        expected = ref.linear(x, weight, b)
        torch.testing.assert_close(kernel_ops.linear(x, weight, b), expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(kernel_ops.linear(x, packed, b), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(BF16, marks=needs_native_bf16)], ids=["f32", "bf16"]
)
def test_linear_panels_reads_the_weight_onednn_keeps(kernel_ops, dtype) -> None:
    """oneDNN keeps a float32 weight in panels of output channels (on AVX2 and AVX-512 alike), and
    a bfloat16 one on AVX512-BF16 without AMX in panels of k pairs (a Xeon with AMX keeps these
    small-K float32 weights unblocked, [K][N], which linear_panels does not read: proven so, bit
    for bit); PackedWeight finds them, checked value by value, and linear_panels on that one
    copy is the float64 product rounded once (float32 sums) for every row count it takes, K odd
    and not a multiple of a vector, or even (bfloat16 reads x's rows as pairs in place); in
    bfloat16, whose kernel takes many rows too (tiles of up to 6, and a last one of fewer), it
    is also oneDNN's result for those rows in a batch of many, to the bit (the blocks of k it
    sums in, found at load). A layout that is not the weight's is refused; without AVX512-BF16,
    or with AMX, bfloat16 stays on oneDNN."""
    gen = torch.Generator().manual_seed(0)
    n = 192  # 3 panels of 64
    # bfloat16: one tile of up to 6 rows, then tiles of 6 and a last one of each smaller size
    row_counts = range(1, 5) if dtype == torch.float32 else (*range(1, 10), 13, 64)
    linear_panels = torch.ops.radixserve.linear_panels
    in_panels = None
    for k in (71, 96):  # K odd (bfloat16 pads the last pair), and even
        weight = torch.randn(n, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        packed = PackedWeight(weight)
        if dtype == BF16 and (not has_avx512_bf16() or has_amx_bf16()):
            assert packed.panels is None  # no vdpbf16ps, or oneDNN's AMX tiles sum otherwise
            return
        if packed.panels is None:  # a Xeon's oneDNN keeps small K unblocked, as [K][N]
            assert dtype == torch.float32 and torch.ops.radixserve.panels_hold(
                packed.packed, weight, n, k
            )
            continue
        in_panels = packed, packed.panels
        assert packed.panels.group == 4 // weight.element_size()
        if dtype == BF16 and k % 2 == 0:
            assert packed.panels.k_pad == k  # linear_panels reads x's rows as pairs in place
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            for b in (None, bias):
                p = packed.panels
                got = linear_panels(x, packed.packed, n, p.k_pad, p.block, p.k_block, b)
                assert got.dtype == dtype
                products = x.double()[:, None, :] * weight.double()[None]
                exact = products.sum(-1) + (0 if b is None else b.double())
                # one rounding of the result, and float32 sums of k products (and the bias)
                rounding = exact.abs() * (2.0**-8 if dtype == BF16 else 2.0**-23)
                bound = products.abs().sum(-1) + (0 if b is None else b.double().abs())
                assert ((got.double() - exact).abs() <= rounding + bound * k * 2**-24).all()
                if dtype == BF16:  # the rows as a prefill of many computes them
                    many = packed.matmul(torch.cat([x, torch.randn(16, k).to(dtype)]), b)
                    assert torch.equal(got, many[:rows])
                if rows < small_kernel_rows(packed):  # what the model runs for these rows
                    assert torch.equal(kernel_ops.linear(x, packed, b), got)
    # only a Xeon with AMX has been seen keeping both unblocked
    assert in_panels is not None or has_amx_bf16()
    if dtype == torch.float32:  # refused by the row count, before any layout is read
        x = torch.randn(5, k).to(dtype)
        with pytest.raises(RuntimeError, match="1 to 4 rows"):
            linear_panels(x, packed.packed, n, k, 64, 0, None)
    k = 71
    weight = torch.randn(n, k, generator=gen).to(dtype)
    packed = PackedWeight(weight)
    if find_panels(weight, packed.packed) is None:  # unblocked: no layout to tell apart
        return
    changed = weight.clone()
    changed[100, 7] += 1
    assert find_panels(changed, packed.packed) is None
    # the same values with k's pairs in the other order: bfloat16's layout is not float32's
    swapped = weight[:, : k - 1].reshape(n, -1, 2).flip(-1).reshape(n, k - 1)
    assert find_panels(swapped, PackedWeight(weight[:, : k - 1]).packed) is None


@pytest.mark.skipif(not has_avx512_bf16(), reason="linear_panels takes bfloat16 on AVX512-BF16")
def test_linear_panels_in_bfloat16_gives_each_row_what_it_gets_alone(kernel_ops) -> None:
    """bfloat16 rows through linear_panels in tiles (of 6, and a last one of each smaller size;
    several blocks of k, each summed from zero and added to the total, as oneDNN sums a wide input)
    equal, to the bit, each row computed alone: whatever the batch, the threads (which may split a
    panel's tiles), the block sizes (oneDNN's for a 1,100-wide input, and 64 k over 200), K odd or
    even, and x's rows read in place (aligned) or copied (a view 2 bytes off)."""
    gen = torch.Generator().manual_seed(1)
    linear_panels = torch.ops.radixserve.linear_panels
    for k, k_block in ((1100, None), (1101, None), (200, 64)):
        weight = torch.randn(192, k, generator=gen).to(BF16)
        bias = torch.randn(192, generator=gen).to(BF16)
        packed = PackedWeight(weight)
        if has_amx_bf16():
            # PackedWeight reads no bfloat16 panels on AMX (_panels_kernel); the kernel's rows
            # must still agree on oneDNN's layout there (seen on a Xeon for K of 71 to 4,864, not
            # these), in the blocks of k it sums wide K in on the EPYC (any several would do).
            p = find_panels(weight, packed.packed)
            assert p is not None
            p = replace(p, k_block=1024)
        else:
            p = packed.panels
            assert p is not None
        k_block = p.k_block if k_block is None else k_block
        assert 0 < k_block < k  # several blocks
        flat = torch.randn(1 + 64 * k, generator=gen).to(BF16)
        for rows in (*range(5, 10), 13, 19, 64):
            aligned = flat[: rows * k].view(rows, k)
            off = flat[1 : 1 + rows * k].view(rows, k)  # 2 bytes past the aligned start
            for x in (aligned, off):
                for b in (None, bias):
                    alone = torch.cat(
                        [
                            linear_panels(
                                x[i : i + 1], packed.packed, 192, p.k_pad, p.block, k_block, b
                            )
                            for i in range(rows)
                        ]
                    )
                    # 2 threads split a panel's tiles between them from 7 rows on, 4 at 19 and
                    # 64; every result kept until compared, so that none is written into a
                    # freed one that held the same values.
                    many = []
                    for threads in (1, 2, 4):
                        with torch_threads(threads):
                            many.append(
                                linear_panels(x, packed.packed, 192, p.k_pad, p.block, k_block, b)
                            )
                    for threads, got in zip((1, 2, 4), many, strict=True):
                        assert torch.equal(got, alone), (rows, threads)
        if packed.panels is not None and k_block == p.k_block:  # and oneDNN's sum for these rows
            x = flat[: 64 * k].view(64, k)
            assert torch.equal(
                linear_panels(x, packed.packed, 192, p.k_pad, p.block, k_block, None),
                packed.matmul(x, None),
            )


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
# A row of fewer elements than a vector, one of blocks and a tail, a vocabulary's width.
@pytest.mark.parametrize("width", [5, 1000, 151936])
def test_argmax_equals_torch_to_the_index(kernel_ops, dtype, width: int) -> None:
    """The greedy pick: the same index as torch.argmax, also where it is a matter of convention:
    ties (the first wins), NaN (the first NaN wins), infinities, rows of one value, and rows
    that are a strided slice of a wider tensor."""
    gen = torch.Generator().manual_seed(width)
    rows = 12
    x = torch.randn(rows, width + 3, generator=gen).to(dtype)[:, :width]  # rows apart in memory
    last = width - 1
    x[1, last] = x[1, 0] = 50.0  # a tie: the earlier index
    x[2, :] = -float("inf")  # all equal: index 0
    x[3, last // 2] = float("inf")
    x[4, last] = float("nan")
    x[4, last // 3] = float("nan")  # two NaNs: the first
    x[5, 0] = float("nan")
    x[6, :] = 0.0
    x[6, last] = -0.0
    x[7, last] = 60.0  # the maximum in the tail, past the last whole block
    x[8, :] = x[8, :].abs().neg()  # all negative
    for logits in (x, x.contiguous()):
        assert torch.equal(kernel_ops.argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(kernel_ops.argmax(logits), TorchOps().argmax(logits))


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_fused_ops_in_bfloat16_are_close_to_torch(kernel_ops, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    ref = TorchOps()
    x = torch.randn(rows, 100, generator=gen).to(BF16)
    w = torch.randn(100, generator=gen).to(BF16)
    out = kernel_ops.rms_norm(x, w, 1e-6)
    assert out.dtype == BF16
    close_in_bf16(out, ref.rms_norm(x, w, 1e-6))

    res_a = torch.randn(rows, 100, generator=gen).to(BF16)
    res_b = res_a.clone()
    out_ref = ref.add_rms_norm(x.clone(), res_a, w, 1e-6)
    out = kernel_ops.add_rms_norm(x.clone(), res_b, w, 1e-6)
    assert torch.equal(res_b, res_a)  # one bf16 add: rounded once either way
    close_in_bf16(out, out_ref)

    qkv = torch.randn(rows, (6 + 2 + 2) * 16, generator=gen).to(BF16)
    q, k, _ = qkv.split((96, 32, 32), dim=-1)
    q, k = q.view(rows, 6, 16), k.view(rows, 2, 16)
    angles = torch.randn(rows, 8, generator=gen)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    expected = ref.rotary(q.clone(), k.clone(), cos, sin)
    got = kernel_ops.rotary(q, k, cos, sin)
    close_in_bf16(got[0], expected[0])
    close_in_bf16(got[1], expected[1])

    gate_up = torch.randn(rows, 2 * 50, generator=gen).to(BF16)
    close_in_bf16(kernel_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))

    weight = (torch.randn(37, 100, generator=gen) / 10).to(BF16)
    bias = torch.randn(37, generator=gen).to(BF16)
    packed = PackedWeight(weight)
    for b in (None, bias):
        expected = ref.linear(x, weight, b)
        for got in (kernel_ops.linear(x, weight, b), kernel_ops.linear(x, packed, b)):
            assert got.dtype == BF16
            close_in_bf16(got, expected)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(BF16, marks=needs_native_bf16)], ids=str
)
def test_cpu_extension_forward_runs_the_extension(tiny_model, dtype) -> None:
    """The profiler names the ops a forward ran: the extension's, and no SDPA; oneDNN on the
    weights reordered at load for a prompt of more rows than linear_small_m takes."""
    # Op by op, so that the profiler sees each (test_fused_layers.py: the same kernels fused).
    runner = _runner(str(tiny_model("qwen3")), dtype, "cpu_extension", fused_layers=False)
    linears = [m for m in runner.model.modules() if isinstance(m, ColumnParallelLinear)]
    assert linears and all(isinstance(m.weight, PackedWeight) for m in linears)
    prompt = SMALL_M + 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.forward_logits(_one_prompt_batch(prompt))
    ran = {e.key for e in prof.key_averages()}
    for op in ("paged_attention", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        assert f"radixserve::{op}" in ran
    # The one-row LM head too: only the oneDNN copy of a weight is kept, which float32 (and
    # bfloat16 on AVX512-BF16 without AMX) reads in its panels for a few rows, where oneDNN laid
    # it out in panels (test_linear_panels_reads_the_weight_onednn_keeps: where it must).
    assert "radixserve::linear_small_m" not in ran
    head = runner.model.lm_head.weight
    assert isinstance(head, PackedWeight)
    # bfloat16's linear_panels takes the prompt's rows too (up to BF16_PANEL_ROWS)
    prompt_on_panels = dtype == BF16 and any(m.weight.panels is not None for m in linears)
    assert ("radixserve::linear_panels" in ran) == (head.panels is not None or prompt_on_panels)
    # The prompt's projections: oneDNN's, or in bfloat16 on AVX512-BF16 without AMX
    # linear_panels on oneDNN's copy (it takes a prompt of up to BF16_PANEL_ROWS rows too).
    prompt_on_onednn = any(prompt >= small_kernel_rows(m.weight) for m in linears)
    assert ("mkldnn::_linear_pointwise" in ran) == prompt_on_onednn
    assert prompt_on_onednn == (dtype == torch.float32 or not has_avx512_bf16() or has_amx_bf16())
    assert "aten::scaled_dot_product_attention" not in ran


@needs_native_bf16
def test_cpu_extension_logits_in_bfloat16_are_close_to_torch_natives(tiny_model) -> None:
    path = str(tiny_model("qwen2", tie_word_embeddings=True))
    logits = {}
    for kernels in ("torch_native", "cpu_extension"):
        runner = _runner(path, BF16, kernels)
        assert runner.kernels_name == kernels
        logits[kernels] = runner.forward_logits(_one_prompt_batch(SMALL_M + 4))
    ref, got = logits["torch_native"], logits["cpu_extension"]
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def _runner(path: str, dtype: torch.dtype, kernels: str, fused_layers: bool = True) -> ModelRunner:
    return ModelRunner(
        path,
        dtype=dtype,
        device=CPU,
        max_total_tokens=64,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels=kernels,
        fused_layers=fused_layers,
    )


def _one_prompt_batch(n: int):
    from test_sampler import make_info

    from radixserve.model_worker.batch import ModelWorkerBatch

    slots = torch.arange(1, n + 1)
    return ModelWorkerBatch(
        input_ids=torch.arange(3, 3 + n),
        positions=torch.arange(n),
        out_cache_loc=slots,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
        kv_slots=slots[None],
        sampling=make_info(1),
    )


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
# 64: the 0.5B's and SmolLM2's heads; 128: Qwen3-8B's; 48: the general loop.
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_paged_attention_rows_do_not_depend_on_their_batch(kernel_ops, dtype, head_dim) -> None:
    """A query row's attention, bit for bit, whether it is the one token of a decode or a row of
    a prefill chunk: a prefix-cache hit, a chunked prefill and a speculative verify (rows of an
    extend) then continue exactly as decoding would."""
    if dtype == BF16 and not has_native_bf16():
        pytest.skip("no bfloat16 in hardware")
    heads, kv_heads, prefix, extend = 8, 2, 100, 21  # 4 query heads a KV head, as Qwen3-8B
    gen = torch.Generator().manual_seed(head_dim)
    k_cache = torch.randn(256, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(256, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(256, generator=gen)[: prefix + extend].view(1, -1)
    q = torch.randn(extend, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(extend, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(extend, kv_heads, head_dim, generator=gen).to(dtype)

    def attend(first: int) -> torch.Tensor:
        """Rows first.. of the extend, over the prefix and the rows before them."""
        return torch.ops.radixserve.paged_attention(
            q[first:],
            k[first:],
            v[first:],
            k_cache,
            v_cache,
            slots[0, prefix + first :],
            slots,
            torch.tensor([prefix + first]),
            torch.tensor([extend - first]),
            head_dim**-0.5,
        )

    chunk = attend(0)
    for first in (extend - 1, extend - 2, 7):  # a decode, two rows, a shorter chunk
        assert torch.equal(attend(first), chunk[first:]), first

    def decode(t: int) -> torch.Tensor:
        """Row t of the extend alone, as a decode over the prefix and the rows before it."""
        return torch.ops.radixserve.paged_attention(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], k_cache, v_cache,
            slots[0, prefix + t : prefix + t + 1], slots,
            torch.tensor([prefix + t]), torch.tensor([1]), head_dim**-0.5,
        )  # fmt: skip

    # Rows inside the chunk, whose last block there holds more keys than the row sees (odd
    # counts beside keys of probability zero, at 101 keys), as a decode of their own.
    for t in (0, 5, 15):
        assert torch.equal(decode(t), chunk[t : t + 1]), t
