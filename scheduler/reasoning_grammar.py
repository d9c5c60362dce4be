"""A grammar that holds only after a reasoning model's thinking (`--reasoning-parser`), as SGLang
and vLLM apply one: the thinking between `<think>` and `</think>` is free text, and the answer
after it follows the grammar.

Where the thinking is follows the reasoning parser (protocol/reasoning_tags.py decides for both),
so that the part the grammar shapes is the part a chat reply gives as its content. A prompt whose
last tag is `<think>` (DeepSeek-R1's template, Qwen3's Thinking-2507) has the output think from
its first token until `</think>`; one whose last tag is `</think>` (the thinking turned off) has
none to wait for. With no tag in the prompt, deepseek-r1 thinks first, and with qwen3 the output
may open with `<think>`: its first token may be that or what the grammar allows.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from radixserve.protocol.reasoning_tags import ThinkTags

if TYPE_CHECKING:
    import xgrammar as xgr


class _Phase(enum.Enum):
    OPENING = 0  # the first token: <think>, or the answer's first
    THINKING = 1  # free until </think>
    ANSWER = 2  # the grammar's


class ThinkThenGrammar:
    """One request's matcher (`Req.grammar`), with xgrammar's GrammarMatcher's three methods
    that the scheduler calls. The tags themselves are never fed to the grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, tags: ThinkTags, thinking: bool):
        self.matcher = matcher
        self.tags = tags
        self.phase = _Phase.THINKING if thinking else _Phase.OPENING

    @property
    def thinking(self) -> bool:
        """Free text for now: min_new_tokens holds EOS back here as without a grammar."""
        return self.phase is _Phase.THINKING

    def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
        if self.phase is _Phase.THINKING:
            return  # the row stays as allocated: every token allowed
        self.matcher.fill_next_token_bitmask(mask, row)
        if self.phase is _Phase.OPENING:
            word, bit = divmod(self.tags.start, 32)
            mask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit

    def accept_token(self, token: int) -> bool:
        if self.phase is _Phase.OPENING and token == self.tags.start:
            self.phase = _Phase.THINKING
            return True
        if self.phase is _Phase.THINKING:
            if token == self.tags.end:
                self.phase = _Phase.ANSWER
            return True
        self.phase = _Phase.ANSWER
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return self.phase is _Phase.ANSWER and bool(self.matcher.is_terminated())
