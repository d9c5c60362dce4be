"""Write a randomly initialised copy of a model with other head counts, for benchmarks of
shapes the model itself does not allow: the default model has 9 query heads and 3 KV heads, so
it runs on --tp-size 1 or 3 only, while a copy with 8 and 2 (head_dim 72: the same widths, the
same FLOPs per token) runs on 2 and 4 as well.

    python benchmarks/random_model.py OUT_DIR [--num-attention-heads 8 --num-key-value-heads 2]

Its tokens are the argmax of random logits: fine for throughput with ignore_eos, not for text.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model whose shape is copied")
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-key-value-heads", type=int, default=2)
    args = parser.parse_args()
    source = Path(resolve_model_path(args.model))
    config = AutoConfig.from_pretrained(source)
    width = config.num_attention_heads * config.head_dim
    if width % args.num_attention_heads:
        parser.error(f"{width} query channels do not split into {args.num_attention_heads} heads")
    config.head_dim = width // args.num_attention_heads
    config.num_attention_heads = args.num_attention_heads
    config.num_key_value_heads = args.num_key_value_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out_dir)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, args.out_dir / name)
    print(f"{args.out_dir}: {args.num_attention_heads} heads, {args.num_key_value_heads} KV heads")


if __name__ == "__main__":
    main()
