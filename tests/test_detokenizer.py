"""The detokenizer with the default model's real byte-level BPE tokenizer, and its process."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.detokenizer.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from radixserve.detokenizer.process import run_detokenizer_process
from radixserve.detokenizer.tokenizer_handoff import decoder_for, hand_over
from radixserve.model_worker.model_source import default_model_dir
from radixserve.process_setup import Heartbeat
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    BatchTokenOut,
    DetokenizerReady,
    ProcessReady,
    ReqStart,
    ReqStrOut,
    ReqTokenOut,
    StopReq,
    TokenizerManagerInput,
)
from radixserve.protocol.wire import FinishReason
from radixserve.server_args import ServerArgs

# Emoji (with ZWJ sequences and flags), CJK, accents and Greek: all split across BPE tokens.
TEXTS = [
    "Hello 👋 world! 你好，世界 café naïve 🇯🇵 👩‍👩‍👧 Ωμέγα",
    "日本語のテキストと絵文字🎉🎉 mixed with ASCII, ñ, ß and ø.",
    "   leading spaces, tabs\t and\nnew lines 🧪\n\n",
]
LENGTH = FinishReason(type="length")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def token_out(
    rid: str,
    ids: list[int],
    finished: FinishReason | None = None,
    skip_special_tokens: bool = True,
    stop: tuple[str, ...] = (),
    first: bool = True,
    context: tuple[int, ...] = (),
) -> ReqTokenOut:
    """An output of request `rid`; its first carries what the request keeps (ReqStart)."""
    start = ReqStart(3, 0, skip_special_tokens, list(stop), list(context)) if first else None
    return ReqTokenOut(
        rid=rid,
        new_token_ids=ids,
        finished_reason=finished,
        completion_tokens=len(ids),
        start=start,
    )


def chunks(ids: list[int], sizes: Iterator[int]) -> list[list[int]]:
    out, start = [], 0
    while start < len(ids):
        size = max(1, next(sizes))
        out.append(ids[start : start + size])
        start += size
    return out


def stream(
    detok: IncrementalDetokenizer,
    rid: str,
    pieces: list[list[int]],
    finish: FinishReason = LENGTH,
    **kw,
) -> list[str]:
    """Feed pieces as successive steps; the last one finishes the request."""
    texts = []
    for i, piece in enumerate(pieces):
        finished = finish if i == len(pieces) - 1 else None
        (out,), _ = detok.step([token_out(rid, piece, finished, first=i == 0, **kw)])
        assert out.rid == rid and out.new_token_ids == piece
        texts.append(out.text)
    return texts


def test_texts_split_inside_characters(tokenizer):
    """Guards the other tests' premise: single tokens of these texts decode to half characters."""
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_emits_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    pieces = stream(detok, "r", [[i] for i in ids])
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert len(detok) == 0


@settings(max_examples=40, deadline=None)
@given(
    text_index=st.integers(0, len(TEXTS) - 1),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=60),
)
def test_any_chunking_gives_the_same_text(tokenizer, text_index, sizes):
    ids = tokenizer.encode(TEXTS[text_index], add_special_tokens=False)
    pieces = stream(
        IncrementalDetokenizer(decoder_for(tokenizer)), "r", chunks(ids, iter(sizes * len(ids)))
    )
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=40), seed=st.integers(0, 2**16))
def test_random_unicode_streams_to_the_whole_decode(tokenizer, text, seed):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    sizes = iter(lambda: rng.randint(1, 4), None)
    pieces = stream(IncrementalDetokenizer(decoder_for(tokenizer)), "r", chunks(ids, sizes))
    # Special tokens are skipped, as the stream does: a tokenizer without byte fallback (the
    # GGUF conversion of older transformers) encodes some characters as <|endoftext|>, its unk.
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_leading_spaces_come_from_the_previous_token():
    """A SentencePiece-style decoder drops the first token's "▁": a lone "▁world" is "world"."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([2]) == "world"
    pieces = stream(IncrementalDetokenizer(decoder_for(tokenizer)), "r", [[1], [2], [3], [2]])
    assert pieces == ["Hello", " world", "!", " world"]


def test_the_first_token_keeps_its_space_after_the_prompt():
    """After the prompt's last ids (ReqStart.context, as SGLang and vLLM decode), a
    SentencePiece "▁Paris" is " Paris": the completion of "... is" reads "is Paris", not
    "isParis"; streamed or whole alike."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt = (1, 2, 3)
    streamed = stream(
        IncrementalDetokenizer(decoder_for(tokenizer)), "r", [[4], [5]], context=prompt
    )
    assert streamed == [" Paris", "."]
    (whole,), _ = IncrementalDetokenizer(decoder_for(tokenizer)).step(
        [token_out("w", [4, 5], LENGTH, context=prompt)]
    )
    assert whole.text == " Paris." and whole.new_token_ids == [4, 5]


def test_a_prompt_ending_inside_a_character_cuts_no_text():
    """A SentencePiece byte fallback writes one replacement character a byte: a prompt ending
    with two of the three bytes of "€" decodes to two of them, which the output's third byte
    turns into one "€". Such ids are left out of the context, and the output reads as decoded
    alone (its space kept), instead of losing its first characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁a": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "▁is": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([1, 2, 3, 4, 5]) == "a€ is"
    pieces = stream(
        IncrementalDetokenizer(decoder_for(tokenizer)), "r", [[4], [5]], context=(1, 2, 3)
    )
    assert "".join(pieces) == tokenizer.decode([4, 5]) == "\ufffd is"


def test_a_byte_level_output_is_the_same_after_the_prompt(tokenizer):
    """For a byte-level BPE the prompt's ids change nothing: the output's own decode, however it
    is split (a prompt ending inside an emoji's tokens included)."""
    prompt = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    inside = next(k for k in range(1, len(prompt)) if tokenizer.decode(prompt[:k])[-1] == "\ufffd")
    for context in (prompt[-5:], prompt[-1:], prompt[:inside][-5:]):
        pieces = stream(
            IncrementalDetokenizer(decoder_for(tokenizer)), "r", [[i] for i in ids], context=context
        )
        assert "".join(pieces) == tokenizer.decode(ids)


def test_all_at_once_equals_one_at_a_time(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    (whole,), _ = detok.step([token_out("r", ids, LENGTH)])
    assert whole.text == "".join(stream(detok, "s", [[i] for i in ids]))


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi 🎉<|im_end|>", add_special_tokens=False)
    assert tokenizer.eos_token_id in ids
    shown = "".join(stream(IncrementalDetokenizer(decoder_for(tokenizer)), "r", [[i] for i in ids]))
    assert shown == "assistant\nHi 🎉"
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    raw = stream(detok, "r", [[i] for i in ids], skip_special_tokens=False)
    assert "".join(raw) == "<|im_start|>assistant\nHi 🎉<|im_end|>"


def test_interleaved_requests_in_one_batch(tokenizer):
    ids = {f"r{k}": tokenizer.encode(t, add_special_tokens=False) for k, t in enumerate(TEXTS)}
    sent = dict.fromkeys(ids, 0)
    texts = dict.fromkeys(ids, "")
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    rng = random.Random(0)
    while sent:
        batch = []
        for rid in list(sent):
            end = min(len(ids[rid]), sent[rid] + rng.randint(1, 3))
            finished = LENGTH if end == len(ids[rid]) else None
            piece = ids[rid][sent[rid] : end]
            batch.append(token_out(rid, piece, finished, first=sent[rid] == 0))
            sent[rid] = end
            if finished:
                del sent[rid]
        outs, _ = detok.step(batch)
        assert [o.rid for o in outs] == [t.rid for t in batch]
        for out in outs:
            assert REPLACEMENT_CHAR not in out.text
            texts[out.rid] += out.text
        assert len(detok) == len(sent)  # a finished request leaves no state behind
    assert texts == {rid: tokenizer.decode(i) for rid, i in ids.items()}


def test_finish_flushes_half_a_character(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    pieces = stream(detok, "r", [[i] for i in ids])
    assert "".join(pieces) == tokenizer.decode(ids)
    assert pieces[-1].endswith(REPLACEMENT_CHAR)
    assert len(detok) == 0


def test_counters_and_reason_pass_through(tokenizer):
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    reason = FinishReason(type="abort")
    (out,), _ = detok.step([token_out("r", [], reason)])
    assert out == ReqStrOut("r", "", [], reason, 3, 0, 0)
    assert len(detok) == 0


def test_a_request_is_kept_from_its_first_output_to_its_final(tokenizer):
    """What the first output brings (counters, stop strings) serves every later output, and
    goes with the final; an output outside that span is a bug between our processes: it raises."""
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok.step([token_out("r", ids[:1], stop=(" three",))])
    assert len(detok) == 1
    with pytest.raises(ValueError, match="started twice"):
        detok.step([token_out("r", ids[1:2])])
    (final,), stops = detok.step([token_out("r", ids[1:], LENGTH, first=False)])
    assert final.finished_reason == FinishReason("stop", " three") and final.text == " two"
    assert (final.prompt_tokens, final.cached_tokens) == (3, 0) and not stops
    assert len(detok) == 0
    with pytest.raises(ValueError, match="has not started or has ended"):
        detok.step([token_out("r", [], LENGTH, first=False)])


def test_stop_string_is_trimmed_and_the_scheduler_ends_the_request(tokenizer):
    ids = tokenizer.encode("Answer: 42.\n\nNext line", add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    # All at once: the text stops where the stop string starts, and the scheduler is asked to
    # end the request; until it has, the request is not finished.
    # The tokens after the one that completes the stop string are not the request's (as vLLM
    # drops them): one output carries several with speculation.
    through = next(k for k in range(1, len(ids)) if "\n\n" in tokenizer.decode(ids[:k]))
    assert through < len(ids) - 1  # "Next line" comes after it
    out = token_out("r", ids, stop=("\n\n",))
    out.output_token_logprobs = [(-0.5, i) for i in ids]
    out.output_top_logprobs = [[(-0.5, i)] for i in ids]
    (whole,), stops = detok.step([out])
    assert whole.text == "Answer: 42." and whole.new_token_ids == ids[:through]
    assert whole.completion_tokens == through and whole.finished_reason is None
    assert whole.output_token_logprobs == [(-0.5, i) for i in ids[:through]]
    assert whole.output_top_logprobs == [[(-0.5, i)] for i in ids[:through]]
    assert stops == [StopReq("r", "\n\n")]
    # Its final ends it as the stop string did, whatever ended it at the scheduler.
    (final,), stops = detok.step([token_out("r", [5, 6], LENGTH, first=False)])
    assert final == ReqStrOut("r", "", [], FinishReason("stop", "\n\n"), 3, through, 0)
    assert not stops and len(detok) == 0


def test_a_stop_string_in_held_text_ends_at_the_first_new_token(tokenizer):
    """A stop string begun in one output (its start held back) and completed by the first of
    the next output's tokens: that token is the last one kept."""
    first = tokenizer.encode("Answer: 42.\n", add_special_tokens=False)
    rest = tokenizer.encode("\nNext line", add_special_tokens=False)
    assert len(rest) > 1 and tokenizer.decode(rest[:1]) == "\n"
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    (out,), stops = detok.step([token_out("r", first, stop=("\n\n",))])
    assert out.text == "Answer: 42." and not stops  # the "\n" may begin the stop string
    more = ReqTokenOut("r", rest, None, len(first) + len(rest))
    (out,), stops = detok.step([more])
    assert out.text == "" and stops == [StopReq("r", "\n\n")]
    assert out.new_token_ids == rest[:1] and out.completion_tokens == len(first) + 1


@pytest.mark.parametrize("stop_str", ["\n\n", "42.\n", "Next", ": 4"])
def test_stop_string_split_across_streamed_chunks(tokenizer, stop_str):
    text = "Answer: 42.\n\nNext line and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    sent, stops = [], []
    for k, i in enumerate(ids):  # one token a step: every stop string here spans several steps
        (out,), stops = detok.step([token_out("s", [i], stop=(stop_str, "never"), first=k == 0)])
        assert out.finished_reason is None
        sent.append(out.text)
        if stops:
            break
    assert "".join(sent) == text[: text.index(stop_str)]  # nothing of the stop string leaked
    assert stops == [StopReq("s", stop_str)]
    # What the scheduler still sends for it before its final is dropped.
    late, _ = detok.step([token_out("s", [ids[-1]], first=False)])
    assert late == []
    (final,), _ = detok.step([token_out("s", [], FinishReason("stop", stop_str), first=False)])
    assert final.finished_reason == FinishReason("stop", stop_str) and final.text == ""
    assert len(detok) == 0


def test_overlapping_stop_strings_end_alike_at_any_output_size(tokenizer):
    """Two stop strings that overlap: the one that ends first ends it, whether the tokens come
    one a step or several in one output (speculation), with the same text, match and tokens."""
    ids = tokenizer.encode("Answer: yes\n\nHuman: next", add_special_tokens=False)
    stop = ("\n\nHuman:", "Human")
    results = []
    for sizes in ([1] * len(ids), [len(ids)]):
        detok = IncrementalDetokenizer(decoder_for(tokenizer))
        texts, kept, stops = [], [], []
        for k, piece in enumerate(chunks(ids, iter(sizes))):
            (out,), stops = detok.step([token_out("r", piece, stop=stop, first=k == 0)])
            texts.append(out.text)
            kept += out.new_token_ids
            if stops:
                break
        results.append(("".join(texts), stops, kept))
    assert results[0] == results[1]
    assert results[0][:2] == ("Answer: yes\n\n", [StopReq("r", "Human")])


def stream_under_min_tokens(tokenizer, text: str, stop: tuple[str, ...], min_new: int):
    """`text`'s tokens one a step to a request with min_new_tokens; what was sent, and the
    stop that matched (None if none did)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    start = ReqStart(3, 0, True, list(stop), [], min_new_tokens=min_new)
    sent = []
    for k, i in enumerate(ids, 1):
        out = ReqTokenOut("r", [i], None, k, start if k == 1 else None)
        (str_out,), stops = detok.step([out])
        sent.append(str_out.text)
        if stops:
            assert str_out.completion_tokens == k > min_new
            return "".join(sent), stops[0].matched
    (last,), _ = detok.step([ReqTokenOut("r", [], LENGTH, len(ids))])
    return "".join(sent) + last.text, None


def test_a_stop_string_ends_the_output_only_past_min_new_tokens(tokenizer):
    """As vLLM's min_tokens: a stop string ending within the first min_new_tokens tokens goes
    by as text; one ending past them stops the output, wherever it began."""
    text = "one. two. three. four."
    through_two = len(tokenizer.encode("one. two.", add_special_tokens=False))
    assert stream_under_min_tokens(tokenizer, text, (".",), 0) == ("one", ".")
    assert stream_under_min_tokens(tokenizer, text, (".",), through_two) == ("one. two. three", ".")
    # Begun under the minimum (its "two." within it), ended past it: it stops the output.
    straddling = stream_under_min_tokens(tokenizer, text, ("two. three",), through_two)
    assert straddling == ("one. ", "two. three")
    assert stream_under_min_tokens(tokenizer, text, (".",), 100) == (text, None)
    # "b" went by under the minimum, still in the text held back for "ab c": past it, "ab c"
    # stops the output where it begins, not where the "b" was.
    within = len(tokenizer.encode("xab", add_special_tokens=False))
    assert stream_under_min_tokens(tokenizer, "xab cd", ("b", "ab c"), within) == ("x", "ab c")


def test_stop_string_in_the_final_output_ends_it_at_once(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    (out,), stops = IncrementalDetokenizer(decoder_for(tokenizer)).step(
        [token_out("r", ids, LENGTH, stop=(" two",))]
    )
    assert out.text == "one" and out.finished_reason == FinishReason("stop", " two")
    assert stops == []  # the scheduler has ended it already


def test_held_back_text_goes_out_when_no_stop_follows(tokenizer):
    ids = tokenizer.encode("a b c d", add_special_tokens=False)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    outs = [token_out("r", [i], stop=("c d e",), first=k == 0) for k, i in enumerate(ids)]
    pieces = [detok.step([out])[0][0].text for out in outs]
    (last,), stops = detok.step([token_out("r", [], LENGTH, first=False)])
    assert "".join(pieces) + last.text == "a b c d" and not stops


def test_matched_stop_token_is_not_shown(tokenizer):
    ids = tokenizer.encode("Hi there.", add_special_tokens=False)
    (out,), _ = IncrementalDetokenizer(decoder_for(tokenizer)).step(
        [token_out("r", ids, FinishReason(type="stop", matched=ids[-1]))]
    )
    assert out.text == "Hi there"
    assert out.new_token_ids == ids


def test_detokenizer_process_over_ipc(model_dir, tokenizer):
    ipc_dir = tempfile.mkdtemp(prefix="rs-detok-")  # 0700, short enough for a socket path
    ctx = zmq.Context()
    reader, writer = multiprocessing.Pipe(duplex=False)
    spawn = multiprocessing.get_context("spawn")
    heartbeat = Heartbeat(spawn)
    proc = spawn.Process(
        target=run_detokenizer_process, args=(ServerArgs(), model_dir, ipc_dir, writer, heartbeat)
    )
    try:
        assert os.stat(ipc_dir).st_mode & 0o777 == 0o700
        results = transport.bind_pull(ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT)
        proc.start()
        writer.close()
        assert not reader.poll(1), "ready before the tokenizer manager handed its tokenizer over"
        hand_over(tokenizer, ipc_dir)  # as the tokenizer manager does once its own is loaded
        assert reader.poll(60), "the detokenizer never reported ready"
        ready = msgspec.msgpack.decode(reader.recv_bytes(), type=ProcessReady)
        assert ready.name == "detokenizer"
        libraries = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in libraries, "the detokenizer loaded torch (and transformers)"

        codec = transport.Codec(TokenizerManagerInput)
        # Told first that it can turn tokens into text: the manager counts that into "ready".
        assert results.poll(10_000) and codec.decode(results.recv()) == DetokenizerReady()
        push = transport.connect_push(ctx, ipc_dir, transport.DETOKENIZER_INPUT)
        ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
        first = [token_out("a", ids[:2]), token_out("b", ids, LENGTH)]
        push.send(codec.encode(BatchTokenOut(outs=first)))
        second = [token_out("a", ids[2:], LENGTH, first=False)]
        push.send(codec.encode(BatchTokenOut(outs=second)))
        replies = []
        for _ in range(2):
            assert results.poll(10_000), "no BatchStrOut from the detokenizer"
            replies.append(codec.decode(results.recv()))
        # ids[:2] is "Hello" and a third of an emoji: held back until the rest comes.
        assert [(o.rid, o.text) for o in replies[0].outs] == [("a", ""), ("b", TEXTS[0])]
        assert [(o.rid, o.text) for o in replies[1].outs] == [("a", TEXTS[0])]

        # A SIGTERM to the whole process group must not end it under the tokenizer manager's
        # drain: the launcher alone stops it, with SIGKILL.
        proc.terminate()
        proc.join(1)
        assert proc.is_alive(), "the detokenizer ended on SIGTERM"
        proc.kill()
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_two_outputs_of_one_request_in_one_step_are_decoded_in_turn(tokenizer):
    """A speculating step can follow the step in flight within one scheduler step: both
    outputs of a request then reach the detokenizer together."""
    ids = tokenizer("fixtures fixtures and a caf\u00e9 by the sea").input_ids
    apart = stream(
        IncrementalDetokenizer(decoder_for(tokenizer)), "r", [ids[:3], ids[3:5], ids[5:]]
    )
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    (first,), _ = detok.step([token_out("r", ids[:3])])
    together, _ = detok.step(
        [token_out("r", ids[3:5], first=False), token_out("r", ids[5:], LENGTH, first=False)]
    )
    assert [first.text, *(o.text for o in together)] == apart
    assert "".join(apart) == tokenizer.decode(ids, skip_special_tokens=True)
