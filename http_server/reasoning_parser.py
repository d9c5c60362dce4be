"""`--reasoning-parser`: a chat completion's thinking, `<think>...</think>`, split from its answer
into `reasoning_content` (SGLang's and vLLM's field), streamed or whole.

qwen3: the thinking is there only when the output opens with `<think>` (Qwen3's template may turn
it off, then the answer comes at once). deepseek-r1: its template writes `<think>` into the
prompt, so the output is thinking until `</think>`, whether or not it repeats the opening tag.
A tag may come split over any number of pieces: a tail that could begin one is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.protocol.reasoning_tags import END, START

REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """One completion's stream: feed each new piece of text, then finish once."""

    def __init__(self, name: str, thinks_first: bool | None = None):
        """`thinks_first`: the output begins inside the thinking (protocol/reasoning_tags.py's
        starts_thinking, from the prompt); by default, as the parser's template writes it."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {name!r}: one of {', '.join(REASONING_PARSERS)}")
        self.thinks_first = name == "deepseek-r1" if thinks_first is None else thinks_first
        self.state = "start"  # start -> reasoning -> content (or start -> content)
        self.buffer = ""
        self.after_end = False  # the answer's leading newlines after </think> are dropped

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split()
        if self.state == "start":
            opening = self.buffer.lstrip()
            if START.startswith(opening):  # all of it may still become "<think>"
                return out
            if opening.startswith(START):
                self.buffer = opening[len(START) :]
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.thinks_first else "content"
        if self.state == "reasoning":
            end = self.buffer.find(END)
            if end < 0:
                keep = held_back(self.buffer, END)
                out.reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            out.reasoning = self.buffer[:end]
            self.buffer = self.buffer[end + len(END) :]
            self.state, self.after_end = "content", True
        if self.state == "content":
            if self.after_end:
                self.buffer = self.buffer.lstrip()
                self.after_end = not self.buffer
            out.content, self.buffer = self.buffer, ""
        return out

    def finish(self) -> Split:
        """What was held back, once the completion has ended."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.thinks_first):
            return Split(reasoning=rest.removeprefix(START) if self.state == "start" else rest)
        return Split(content=rest)


def split_reasoning(name: str, text: str) -> Split:
    """A whole completion's text, split."""
    parser = ReasoningParser(name)
    first, last = parser.feed(text), parser.finish()
    return Split(first.reasoning + last.reasoning, first.content + last.content)
