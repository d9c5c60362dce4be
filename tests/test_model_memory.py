"""The model runner holds one copy of the weights, touches the KV pool only as it is used, and
refuses weights that do not fit before loading any (issue 21)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixserve.model_worker.cpu_features import has_native_bf16
from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.loader import loadable_modules, safetensors_files
from radixserve.model_worker.model_loading import NotEnoughMemory
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import release_freed_memory

# Large enough (~80 MB in float32) that a second copy would stand out of the RSS.
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
    tie_word_embeddings=False,
)
CONFIGS = [
    pytest.param(torch.float32, None, id="float32"),
    pytest.param(torch.float32, "int8", id="int8"),
    pytest.param(
        torch.bfloat16,
        None,
        id="bfloat16",
        marks=pytest.mark.skipif(not has_native_bf16(), reason="no bfloat16 in hardware"),
    ),
]


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def checkpoint_elements(path: Path) -> int:
    total = 0
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def runner(path: Path, dtype: torch.dtype, quantization: str | None, **kw) -> ModelRunner:
    return ModelRunner(
        str(path),
        dtype=dtype,
        device=torch.device("cpu"),
        tp=TPGroup(),
        seed=0,
        quantization=quantization,
        **({"max_total_tokens": 64, "mem_fraction_static": 0.0} | kw),
    )


@pytest.mark.parametrize(("dtype", "quantization"), CONFIGS)
def test_one_copy_of_the_weights(tiny_model, dtype, quantization) -> None:
    """Every buffer the model and its kernels hold, counted once, is the checkpoint's size in the
    final form; the process grew by about that, not by twice, though its KV pool is sized from
    the free memory (its pages are taken only when written)."""
    path = tiny_model("qwen3", **SHAPE)
    load_cpu_kernels()  # built and loaded before measuring
    before = rss_bytes()
    r = runner(path, dtype, quantization, max_total_tokens=None, mem_fraction_static=0.5)
    release_freed_memory()  # the loading's temporaries, as the idle server gives them back
    grown = rss_bytes() - before

    held = sum(t.nbytes for t in r.weight_tensors())
    planned = sum(m.planned_bytes() for m in loadable_modules(r.model).values())
    assert held == planned
    if quantization is None:
        assert held == checkpoint_elements(path) * dtype.itemsize
    else:  # the linear layers in int8, the embedding and norms in float32
        assert held < 0.5 * checkpoint_elements(path) * dtype.itemsize
    kv_bytes = r.max_total_tokens * r.kv_pool.bytes_per_slot(4, 2, 64, dtype)
    assert kv_bytes > held  # a pool that, written, would show in the RSS
    # Only an upper bound: memory freed by earlier tests may be reused.
    assert grown < 1.5 * held, (grown, held)


def test_weights_that_do_not_fit_are_refused_before_loading(tmp_path: Path) -> None:
    """A config far larger than this machine's memory, with no weight files at all: the check
    runs on the config's shapes, before any file is read."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 16384,
        "intermediate_size": 65536,
        "num_hidden_layers": 400,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotEnoughMemory, match=r"^the weights take [\d.]+ GB \(torch.float32\) "):
        runner(tmp_path, torch.float32, None)


def test_the_lm_head_loads_first(tiny_model, caplog) -> None:
    """The LM head is read before the other weights, from whichever file holds it (one of the
    last here, as an 8B's): the plain copy oneDNN reorders it from lies beside nothing else
    loaded, instead of beside all the weights."""
    path = tiny_model("qwen3", max_shard_size="40KB", tie_word_embeddings=False)
    files = safetensors_files(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    head_file = index["lm_head.weight"]
    head_number = [f.name for f in files].index(head_file) + 1
    assert head_number > 2
    with caplog.at_level(logging.INFO, logger="radixserve.model_worker.loader"):
        runner(path, torch.float32, None)
    loads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Loading weights")]
    assert loads[0].startswith(f"Loading weights (the LM head first): file {head_number}/")
    assert head_file in loads[0]
    assert "LM head" not in "".join(loads[1:])


def test_a_kv_pool_past_the_memory_is_held_to_it(tiny_model, caplog) -> None:
    """--max-total-tokens past what the memory holds: on the CPU the pool's pages are taken only
    as written, so it would start, and the OOM killer would end it once full. It holds what the
    available memory does, and says so."""
    from radixserve.model_worker.host_memory import meminfo_bytes

    path = tiny_model("llama")
    asked = 10**12
    with caplog.at_level(logging.WARNING, logger="radixserve.model_worker.model_runner"):
        held = runner(path, torch.float32, None, max_total_tokens=asked)
    slot = held.kv_pool.bytes_per_slot(
        held.model_config.num_hidden_layers,
        held.model_config.num_key_value_heads,
        held.model_config.head_dim,
        torch.float32,
    )
    assert 1 <= held.max_total_tokens < asked
    assert held.max_total_tokens * slot <= 2 * meminfo_bytes("MemAvailable")
    (warning,) = [r.getMessage() for r in caplog.records if "--max-total-tokens" in r.getMessage()]
    assert f"the KV pool holds {held.max_total_tokens} tokens" in warning
    assert runner(path, torch.float32, None, max_total_tokens=100).max_total_tokens == 100
