"""The decoder layers in one call of the CPU extension (model_worker/fused_layers.py) against the
modules that run them op by op: the same logits and the same KV pool to the bit, on prompts and
decodes of every row count around the kernels' thresholds, in float32, int8 and (where the CPU
has it) bfloat16, for each model family's extras (Qwen3's q/k norms, Qwen2's q/k/v biases,
Llama's o_proj and MLP biases)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_sampler import make_info

from radixserve.model_worker import fused_ops, int8_weight
from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.cpu_features import has_amx_bf16, has_avx512_bf16, has_native_bf16
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.fused_ops import PANEL_ROWS, SMALL_M, CpuKernelOps
from radixserve.model_worker.int8_weight import INT8_GEMM_MIN_ROWS, int8_small_rows
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.weight_format import WeightFormat

CPU = torch.device("cpu")
MODELS = {
    "qwen3": {},
    "qwen2": {"tie_word_embeddings": True},
    "llama": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
}
CONFIGS = [
    pytest.param(torch.float32, None, id="float32"),
    pytest.param(torch.float32, "int8", id="int8"),
    pytest.param(
        torch.bfloat16,
        None,
        id="bfloat16",
        marks=pytest.mark.skipif(not has_native_bf16(), reason="no bfloat16 in hardware"),
    ),
    pytest.param(
        torch.bfloat16,
        "int8",
        id="bfloat16-int8",
        marks=pytest.mark.skipif(not has_native_bf16(), reason="no bfloat16 in hardware"),
    ),
]
# Rows per step, each side of every kernel threshold: the row count picks the kernel.
THRESHOLDS = (PANEL_ROWS + 1, SMALL_M + 1, INT8_GEMM_MIN_ROWS)
STEP_ROWS = sorted({1, 12} | set(THRESHOLDS) | {t - 1 for t in THRESHOLDS})


def _runner(path: str, dtype: torch.dtype, quantization: str | None, fused: bool) -> ModelRunner:
    runner = ModelRunner(
        path,
        dtype=dtype,
        device=CPU,
        max_total_tokens=512,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels="cpu_extension",
        quantization=quantization,
        fused_layers=fused,
    )
    # The pool's pages are not written until used: zeroed here, the two pools compare whole.
    for buffer in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:
        buffer.zero_()
    return runner


def _steps() -> list[ModelWorkerBatch]:
    """One request per row count: a prompt of `rows` tokens, then steps that decode every
    request at once and extend the first by a chunk of `rows` (a mixed batch)."""
    gen = torch.Generator().manual_seed(0)
    batches, lens, next_slot = [], [], 1
    slots: list[list[int]] = []
    for rows in STEP_ROWS:  # the prompts, one per step
        new = list(range(next_slot, next_slot + rows))
        next_slot += rows
        slots.append(new)
        lens.append(rows)
        batches.append(_batch(gen, [(0, new)]))
    for _ in range(2):  # decodes of all, and a chunk of the first
        seqs = []
        for i in range(len(slots)):
            extend = STEP_ROWS[-1] if i == 0 else 1
            new = list(range(next_slot, next_slot + extend))
            next_slot += extend
            seqs.append((len(slots[i]), slots[i] + new))
            slots[i] = slots[i] + new
        batches.append(_batch(gen, seqs))
    return batches


def _batch(gen: torch.Generator, seqs: list[tuple[int, list[int]]]) -> ModelWorkerBatch:
    """seqs: (prefix length, every slot of the sequence) each."""
    width = max(len(s) for _, s in seqs)
    kv_slots = torch.zeros(len(seqs), width, dtype=torch.int64)
    out_cache_loc, positions = [], []
    for i, (prefix, all_slots) in enumerate(seqs):
        kv_slots[i, : len(all_slots)] = torch.tensor(all_slots)
        out_cache_loc += all_slots[prefix:]
        positions += range(prefix, len(all_slots))
    return ModelWorkerBatch(
        input_ids=torch.randint(0, 100, (len(positions),), generator=gen),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(out_cache_loc),
        prefix_lens=torch.tensor([p for p, _ in seqs]),
        extend_lens=torch.tensor([len(s) - p for p, s in seqs]),
        kv_slots=kv_slots,
        sampling=make_info(len(seqs)),
    )


@pytest.mark.parametrize(("dtype", "quantization"), CONFIGS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_fused_layers_equal_the_modules_to_the_bit(tiny_model, kind, dtype, quantization) -> None:
    _assert_fused_equals_modules(str(tiny_model(kind, **MODELS[kind])), dtype, quantization)


def test_fused_layers_equal_the_modules_without_onednn(tiny_model, monkeypatch) -> None:
    """Plain weights (no oneDNN copy): linear_small_m, then F.linear."""
    monkeypatch.setattr(CpuKernelOps, "weight_format", lambda self: WeightFormat.PLAIN)
    _assert_fused_equals_modules(str(tiny_model("qwen2")), torch.float32, None)


@pytest.mark.parametrize("onednn", [True, False], ids=["int8_gemm", "int8_linear_alone"])
def test_fused_layers_equal_the_modules_on_plain_int8(tiny_model, monkeypatch, onednn) -> None:
    """The plain int8 layout, as CPUs without AVX512-VNNI keep it: int8_linear, then oneDNN's
    int8 matmul; or, with oneDNN held below VNNI (inexact int8 sums), int8_linear at every row
    count."""
    monkeypatch.setattr(int8_weight, "vnni_layout_available", lambda: False)
    if not onednn:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        assert int8_small_rows() > STEP_ROWS[-1]
    _assert_fused_equals_modules(str(tiny_model("qwen3")), torch.float32, "int8")


@pytest.mark.skipif(
    not has_avx512_bf16() or has_amx_bf16(),
    reason="linear_panels takes bfloat16 on AVX512-BF16 without AMX (packed_linear._panels_kernel)",
)
def test_fused_layers_equal_the_modules_around_bf16_panel_rows(tiny_model, monkeypatch) -> None:
    """bfloat16's linear_panels for as many rows as BF16_PANEL_ROWS (6 here, so that the steps'
    row counts cross it; 256 as served), oneDNN from there on."""
    monkeypatch.setattr(fused_ops, "BF16_PANEL_ROWS", 6)
    assert min(STEP_ROWS) <= 6 < max(STEP_ROWS)
    _assert_fused_equals_modules(str(tiny_model("qwen2")), torch.bfloat16, None)


def _assert_fused_equals_modules(path: str, dtype: torch.dtype, quantization: str | None) -> None:
    fused = _runner(path, dtype, quantization, fused=True)
    modules = _runner(path, dtype, quantization, fused=False)
    assert fused.model.model.fused_layers is not None and modules.model.model.fused_layers is None
    for step, batch in enumerate(_steps()):
        every_row = torch.arange(batch.input_ids.numel())
        got = fused.forward_logits(batch, rows=every_row)
        expected = modules.forward_logits(batch, rows=every_row)
        assert torch.equal(got, expected), f"step {step}: {(got - expected).abs().max()}"
    for a, b in zip(
        fused.kv_pool.k_buffers + fused.kv_pool.v_buffers,
        modules.kv_pool.k_buffers + modules.kv_pool.v_buffers,
        strict=True,
    ):
        assert torch.equal(a, b)


def test_fused_layers_run_in_one_call(tiny_model) -> None:
    """The profiler sees the modules' paged_attention op once a layer; the fused layers call
    the kernel directly."""
    path = str(tiny_model("qwen3"))
    ran = {}
    for fused in (True, False):
        runner = _runner(path, torch.float32, None, fused)
        batch = _steps()[0]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runner.forward_logits(batch)
        ran[fused] = {e.key: e.count for e in prof.key_averages()}
    layers = runner.model_config.num_hidden_layers
    assert ran[False]["radixserve::paged_attention"] == layers
    assert "radixserve::paged_attention" not in ran[True]


def test_fused_layers_let_other_threads_run(tiny_model) -> None:
    """The one long call releases the GIL, as each op does: with overlap scheduling the
    scheduler's thread plans the next step while the worker thread runs this one."""
    runner = _runner(str(tiny_model("qwen3", num_hidden_layers=64)), torch.float32, None, True)
    fb = ForwardBatch.from_worker_batch(_steps()[-1], CPU, runner.kv_pool)
    runner.attn_backend.init_forward_metadata(fb)
    layers = runner.model.model.fused_layers
    assert layers is not None
    hidden = torch.randn(fb.input_ids.numel(), runner.model_config.hidden_size)
    cos, sin = runner.model.model.rotary.cos_sin(fb.positions, hidden.dtype)
    marks: list[str] = []  # "begin", then "end", around the call

    def one_call() -> None:
        with torch.inference_mode():
            marks.append("begin")
            layers(hidden, torch.zeros_like(hidden), cos, sin, fb)
            marks.append("end")

    worker = threading.Thread(target=one_call)
    worker.start()
    during = 0  # the main thread's turns while the call ran
    while worker.is_alive():
        during += marks == ["begin"]
    worker.join()
    assert marks == ["begin", "end"], "the call failed"
    assert during > 100, f"the main thread ran {during} times in the call"
