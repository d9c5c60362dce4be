"""A grammar that holds only after a reasoning model's thinking (`--reasoning-parser`), as SGLang
and vLLM apply one: the thinking between `<think>` and `</think>` is free text, and the answer
after it follows the grammar.

Where the thinking is, follows the reasoning parser (http_server/reasoning_parser.py), so that
the part the grammar shapes is the part a chat reply gives as its content. qwen3: the output
thinks only if it opens with `<think>`; so the first token may be that, or what the grammar
allows. deepseek-r1: its template writes `<think>` into the prompt, so the output thinks from
its first token until `</think>`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.http_server.reasoning_parser import END, START

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("radixserve.scheduler")


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    start: int
    end: int
    opens_thinking: bool  # deepseek-r1: the prompt has opened the thinking already


def think_tokens(tokenizer: PreTrainedTokenizerBase, parser: str) -> ThinkTokens | None:
    """The tags' ids in this tokenizer; None where either is not one token (the grammar then
    holds from the first token, and a warning says so)."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
    if any(len(tag_ids) != 1 for tag_ids in ids):
        logger.warning(
            "--reasoning-parser %s: %s and %s are not one token each in this tokenizer; "
            "grammars hold from the first output token",
            parser,
            START,
            END,
        )
        return None
    return ThinkTokens(ids[0][0], ids[1][0], opens_thinking=parser == "deepseek-r1")


class _Phase(enum.Enum):
    OPENING = 0  # the first token: <think>, or the answer's first
    THINKING = 1  # free until </think>
    ANSWER = 2  # the grammar's


class ThinkThenGrammar:
    """One request's matcher (`Req.grammar`), with xgrammar's GrammarMatcher's three methods
    that the scheduler calls. The tags themselves are never fed to the grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, tokens: ThinkTokens):
        self.matcher = matcher
        self.tokens = tokens
        self.phase = _Phase.THINKING if tokens.opens_thinking else _Phase.OPENING

    def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
        if self.phase is _Phase.THINKING:
            return  # the row stays as allocated: every token allowed
        self.matcher.fill_next_token_bitmask(mask, row)
        if self.phase is _Phase.OPENING:
            word, bit = divmod(self.tokens.start, 32)
            mask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit

    def accept_token(self, token: int) -> bool:
        if self.phase is _Phase.OPENING and token == self.tokens.start:
            self.phase = _Phase.THINKING
            return True
        if self.phase is _Phase.THINKING:
            if token == self.tokens.end:
                self.phase = _Phase.ANSWER
            return True
        self.phase = _Phase.ANSWER
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return self.phase is _Phase.ANSWER and bool(self.matcher.is_terminated())
