"""The tokenizer the detokenizer decodes with, handed to it by the tokenizer manager.

Loaded through transformers, a tokenizer costs a process ~4 s of CPU (transformers imports torch
and scans its model code) and ~300 MB, and on a 2-core machine every start waited for it. The
tokenizer manager loads one anyway. Where transformers decodes with the Rust tokenizer alone (a
fast tokenizer whose class overrides no decode step), the manager writes that Rust tokenizer, as
transformers built it (its added tokens and their special flags included), into the private IPC
directory, and the detokenizer decodes with the `tokenizers` package: the same text, without
torch or transformers in the process. Any other tokenizer (a slow one, or one that cannot be
written as JSON) is loaded through transformers there, as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

HANDOFF_FILE = "detokenizer-tokenizer.json"  # empty: load the tokenizer through transformers
POLL_S = 0.02
# What transformers runs between batch_decode and the Rust tokenizer's decode.
DECODE_STEPS = ("batch_decode", "decode", "_decode")


class Decoder(Protocol):
    """What the detokenizer asks of a tokenizer."""

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]: ...


class RustDecoder:
    """A `tokenizers.Tokenizer`, one sequence at a time on this thread: its decode_batch hands
    the sequences to rayon's pool, whose threads would take the cores from the model's."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]:
        decode = self._tokenizer.decode
        return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]


class TransformersDecoder:
    """A tokenizer that only transformers decodes right (a slow, Python one)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]:
        # Clean-up rewrites spaces around punctuation across chunk borders, so a streamed text
        # would no longer equal the same ids decoded at once (the Rust decode never cleans up).
        return self._tokenizer.batch_decode(
            sequences, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def decoder_for(tokenizer: PreTrainedTokenizerBase) -> Decoder:
    """What decodes as `tokenizer` does: its Rust tokenizer where that is all it decodes with."""
    rust = rust_tokenizer(tokenizer)
    return TransformersDecoder(tokenizer) if rust is None else RustDecoder(rust)


def rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls, base = type(tokenizer), PreTrainedTokenizerFast
    if any(getattr(cls, step) is not getattr(base, step) for step in DECODE_STEPS):
        return None
    return tokenizer.backend_tokenizer


def hand_over(tokenizer: PreTrainedTokenizerBase, ipc_dir: str) -> None:
    """In the tokenizer manager, once its tokenizer is loaded."""
    rust = rust_tokenizer(tokenizer)
    try:
        text = "" if rust is None else rust.to_str()
    except Exception:  # a part written in Python (a custom pre-tokenizer) has no JSON
        text = ""
    path = Path(ipc_dir) / HANDOFF_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)  # whole or absent: the detokenizer never reads half of it


def take_over(ipc_dir: str, model_path: str, waiting: Callable[[], None]) -> Decoder:
    """In the detokenizer: waits for the tokenizer manager's file, calling `waiting` meanwhile.
    A manager that fails first takes the server down, and this process with it."""
    path = Path(ipc_dir) / HANDOFF_FILE
    while not path.exists():
        waiting()
        time.sleep(POLL_S)
    text = path.read_text(encoding="utf-8")
    if text:
        from tokenizers import Tokenizer

        return RustDecoder(Tokenizer.from_str(text))
    from transformers import AutoTokenizer

    return TransformersDecoder(AutoTokenizer.from_pretrained(model_path))
