"""Write a model of a named shape with random bfloat16 weights, for benchmarks of shapes we did not
tune to and of models too large to download here.

    python benchmarks/random_model.py OUT_DIR [--shape qwen2-0.5b|qwen3-8b|default-8-heads]
                                      [--untied] [--shard-gb 2]

- `qwen2-0.5b`: Qwen2-0.5B's shape (24 layers, hidden 896, 14/2 heads, intermediate 4864, vocab
  151936, tied embeddings, q/k/v biases).
- `qwen3-8b`: Qwen3-8B's (36 layers, hidden 4096, 32/8 heads of 128, intermediate 12288, vocab
  151936, q/k norms, untied): 16.4 GB.
- `default-8-heads` (the default): the default model with 8 query and 2 KV heads instead of 9 and 3
  (head_dim 72: the same widths and FLOPs per token), so that it runs on --tp-size 2 and 4 too.

`--untied` gives the model an LM head of its own (last in the last file, as an 8B's: what the
loader's peak depends on); `--shard-gb` caps each file's size.

The tokenizer is the default model's, whose vocabulary is smaller than these models' (as real
Qwen models have more embedding rows than tokens). The safetensors shards are written one at a
time, so this script holds about one shard in memory. Its tokens are the argmax of random logits:
fine for throughput with ignore_eos, not for text.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from radixserve.model_worker.model_source import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
INIT_STD = 0.02  # small enough that 36 layers of random weights keep the activations finite

QWEN2_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def default_8_heads() -> dict[str, Any]:
    config = json.loads((default_model_dir() / "config.json").read_text())
    config["head_dim"] = config["num_attention_heads"] * config["head_dim"] // 8
    config.update(num_attention_heads=8, num_key_value_heads=2)
    return config


SHAPES = {
    "default-8-heads": default_8_heads,
    "qwen2-0.5b": lambda: dict(QWEN2_0_5B),
    "qwen3-8b": lambda: dict(QWEN3_8B),
}


def checkpoint_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama/Qwen2/Qwen3 checkpoint, with its shape, in HF's order."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qwen2 = config["model_type"] == "qwen2"
    yield "model.embed_tokens.weight", (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            yield f"{p}self_attn.{name}_proj.weight", (rows * head_dim, hidden)
            if qwen2:
                yield f"{p}self_attn.{name}_proj.bias", (rows * head_dim,)
        yield f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim)
        if config["model_type"] == "qwen3":
            yield f"{p}self_attn.q_norm.weight", (head_dim,)
            yield f"{p}self_attn.k_norm.weight", (head_dim,)
        yield f"{p}mlp.gate_proj.weight", (inter, hidden)
        yield f"{p}mlp.up_proj.weight", (inter, hidden)
        yield f"{p}mlp.down_proj.weight", (hidden, inter)
        yield f"{p}input_layernorm.weight", (hidden,)
        yield f"{p}post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.get("tie_word_embeddings"):
        yield "lm_head.weight", (config["vocab_size"], hidden)


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * INIT_STD).to(torch.bfloat16)


def write_shards(config: dict[str, Any], out_dir: Path, seed: int, shard_bytes_max: int) -> int:
    """Writes the safetensors shards and their index; returns the bytes written."""
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    total = shard_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        file = f"model-{len(shard_names) + 1:05d}.safetensors"
        save_file(shard, out_dir / file, metadata={"format": "pt"})
        shard_names.append(list(shard))
        weight_map.update(dict.fromkeys(shard, file))
        print(f"{out_dir / file}: {shard_bytes / 1e9:.2f} GB", flush=True)
        shard, shard_bytes = {}, 0

    for name, shape in checkpoint_shapes(config):
        tensor = random_tensor(name, shape, gen)
        if shard and shard_bytes + tensor.nbytes > shard_bytes_max:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
    flush()
    # Rename the shards to HF's model-0000i-of-0000n pattern now that n is known.
    count = len(shard_names)
    renamed = {
        f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{count:05d}.safetensors"
        for i in range(1, count + 1)
    }
    for old, new in renamed.items():
        (out_dir / old).rename(out_dir / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: renamed[file] for name, file in weight_map.items()},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="default-8-heads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="an LM head of its own")
    parser.add_argument("--shard-gb", type=float, default=2 * 1024**3 / 1e9)
    args = parser.parse_args()
    config = SHAPES[args.shape]()
    if args.untied:
        config["tie_word_embeddings"] = False
    source = default_model_dir()
    special = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = special.get(key)
    config["torch_dtype"] = config["dtype"] = "bfloat16"  # transformers v4 and v5 keys
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (args.out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, args.out_dir / name)
    total = write_shards(config, args.out_dir, args.seed, int(args.shard_gb * 1e9))
    print(f"{args.out_dir}: {args.shape}, {total / 1e9:.2f} GB of bfloat16 weights")


if __name__ == "__main__":
    main()
