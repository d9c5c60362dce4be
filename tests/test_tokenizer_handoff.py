"""The tokenizer the tokenizer manager hands to the detokenizer through the IPC directory decodes
every id sequence to transformers' own text, special tokens kept or skipped; a tokenizer whose
class decodes otherwise is loaded through transformers instead."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixserve.detokenizer.tokenizer_handoff import (
    HANDOFF_FILE,
    RustDecoder,
    TransformersDecoder,
    hand_over,
    take_over,
)
from radixserve.model_worker.model_source import default_model_dir


def _llama_style() -> PreTrainedTokenizerFast:
    """SentencePiece-like: "▁" for spaces, bytes as <0x..> tokens, and added special tokens."""
    vocab = {"<unk>": 0, "▁a": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "▁is": 5, "b": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eot|>", "<|tool|>"]})
    tokenizer.add_tokens(["<think>"])  # added, not special: shown even when skipping
    return tokenizer


TOKENIZERS = {
    "the default model's byte-level BPE": lambda: AutoTokenizer.from_pretrained(
        default_model_dir()
    ),
    "a SentencePiece-style one with added tokens": _llama_style,
}


def _sequences(tokenizer: PreTrainedTokenizerBase, seed: int) -> list[list[int]]:
    """Random ids, every added token among them, and some real text's."""
    rng = random.Random(seed)
    size = len(tokenizer)
    added = list(tokenizer.added_tokens_decoder)
    seqs = [[rng.randrange(size) for _ in range(rng.randrange(1, 40))] for _ in range(40)]
    seqs += [rng.sample(added, len(added)) + [rng.randrange(size)] for _ in range(5)]
    seqs.append(tokenizer("Hello, world! A caf\u00e9 \u20ac and \U0001f9ea").input_ids)
    return seqs


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_handed_over_tokenizer_decodes_as_transformers(name, tmp_path):
    tokenizer = TOKENIZERS[name]()
    hand_over(tokenizer, str(tmp_path))
    assert (tmp_path / HANDOFF_FILE).stat().st_size > 0, "a fast tokenizer is handed over"
    decoder = take_over(str(tmp_path), "never-read", lambda: None)
    assert isinstance(decoder, RustDecoder)  # no transformers behind it
    seqs = _sequences(tokenizer, seed=len(name))
    for skip in (False, True):
        expected = tokenizer.batch_decode(
            seqs, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
        assert decoder.decode_batch(seqs, skip_special_tokens=skip) == expected
    special = tokenizer.convert_tokens_to_ids("<|im_end|>" if "default" in name else "<|eot|>")
    assert decoder.decode_batch([[special]], skip_special_tokens=True) == [""]


def test_a_tokenizer_that_decodes_in_python_is_loaded_through_transformers(tmp_path):
    """A class that overrides a decode step (as CodeGen's and Whisper's do) hands over nothing:
    the detokenizer loads the model's own tokenizer, and decodes as transformers does."""
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    class PythonDecoding(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs)

    hand_over(PythonDecoding.from_pretrained(model_dir), str(tmp_path))
    assert (tmp_path / HANDOFF_FILE).read_text() == ""
    decoder = take_over(str(tmp_path), str(model_dir), lambda: None)
    assert isinstance(decoder, TransformersDecoder)
    seqs = _sequences(tokenizer, seed=1)
    expected = tokenizer.batch_decode(seqs, skip_special_tokens=True)
    assert decoder.decode_batch(seqs, skip_special_tokens=True) == expected


def test_a_tokenizer_with_a_part_written_in_python_is_loaded_through_transformers(tmp_path):
    """Such a part (RoFormer's jieba pre-tokenizer, say) has no JSON: the file says so."""

    class Whitespace:
        def pre_tokenize(self, pretok):
            pretok.split(lambda i, s: s.split())

    tokenizer = _llama_style()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(Whitespace())
    hand_over(tokenizer, str(tmp_path))
    assert (tmp_path / HANDOFF_FILE).read_text() == ""


def test_the_detokenizer_waits_for_the_whole_file(tmp_path: Path):
    """It beats its heartbeat meanwhile; a file being written is never read half."""
    tokenizer = _llama_style()
    beats = []
    writer = threading.Timer(0.5, hand_over, (tokenizer, str(tmp_path)))
    writer.start()
    decoder = take_over(str(tmp_path), "never-read", lambda: beats.append(1))
    writer.join()
    assert len(beats) >= 3
    assert decoder.decode_batch([[1, 2, 3, 4, 5]], skip_special_tokens=True) == ["a\u20ac is"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [HANDOFF_FILE]
