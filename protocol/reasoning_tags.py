"""A reasoning model's thinking tags (`--reasoning-parser`), and whether an output starts inside
its thinking. One definition for the two places that must agree on it: the scheduler, which
holds a grammar until the thinking ends (scheduler/reasoning_grammar.py), and the HTTP front,
which splits the thinking from the answer (http_server/reasoning_parser.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ThinkTags:
    start: int
    end: int


def think_tags(tokenizer: PreTrainedTokenizerBase) -> ThinkTags | None:
    """The tags' ids; None where either is not one token of this tokenizer (then no grammar
    waits for the thinking: ids cannot show where it ends)."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
    if any(len(tag_ids) != 1 for tag_ids in ids):
        return None
    return ThinkTags(ids[0][0], ids[1][0])


def starts_thinking(parser: str, prompt_ids: list[int], tags: ThinkTags | None) -> bool:
    """Whether the output begins inside the thinking: the prompt's last tag decides, where the
    tags' ids show it. A template that opens the thinking writes `<think>` last (DeepSeek-R1's,
    Qwen3's Thinking-2507); one with the thinking turned off writes both. With no tag in the
    prompt, as the parser's template does: deepseek-r1 thinks first, qwen3's output opens the
    thinking itself with `<think>`. (A tag the user typed counts too: ids cannot tell.)"""
    if tags is not None:
        # Searched in C (a Python loop took 10 ms of the event loop for 128k ids).
        backwards = prompt_ids[::-1]
        start, end = (_index(backwards, tag) for tag in (tags.start, tags.end))
        if start != end:  # equal only where neither is there
            return start < end
    return parser == "deepseek-r1"


def _index(ids: list[int], token: int) -> int:
    """Where `token` first is in `ids`; past the end where it is not."""
    try:
        return ids.index(token)
    except ValueError:
        return len(ids)
