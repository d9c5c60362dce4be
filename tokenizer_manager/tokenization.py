"""Prompts to token ids: raw text, a chat conversation through the model's template, or ids.

Tokenizing runs on one worker thread, off the event loop: a long prompt then delays only the
requests that come after it, never the streams already running (the tokenizer releases the GIL
while it works). One thread keeps requests in their order, and a tokenizer is not safe to call
from two threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import jinja2
from transformers import AutoTokenizer

from radixserve.protocol.wire import GenerateRequest


class PromptTooLong(ValueError):
    pass


class Tokenization:
    def __init__(self, model_path: str, vocab_size: int, context_len: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = vocab_size
        # No token stands for more characters than its own spelling has, so a text longer than
        # this cannot fit the context: it is refused before the tokenizer spends seconds on it.
        longest_token = max(map(len, self.tokenizer.get_vocab()))
        self.max_prompt_chars = context_len * longest_token
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def input_ids_async(self, req: GenerateRequest) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self.input_ids, req)

    async def token_texts_async(self, ids: list[int]) -> list[str]:
        """Each token's own text (OpenAI's logprobs name tokens so), on the worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._token_texts, ids)

    def _token_texts(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids])

    def input_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids; ValueError naming the field for ids outside the vocabulary,
        PromptTooLong for a text that cannot fit the context."""
        self._check_ids("sampling_params.stop_token_ids", req.sampling_params.stop_token_ids)
        if req.input_ids is not None:
            self._check_ids("input_ids", req.input_ids)
            return req.input_ids
        if req.messages is not None:
            if self.tokenizer.chat_template is None:
                raise ValueError("messages: this model has no chat template; send text")
            self._check_length("messages", sum(len(m.content) for m in req.messages))
            try:
                text = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in req.messages],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            except jinja2.TemplateError as e:  # its raise_exception: roles out of order, say
                raise ValueError(f"messages: the model's chat template refused them: {e}") from None
            # The template already wrote the special tokens (BOS, role markers).
            return self.tokenizer(text, add_special_tokens=False).input_ids
        assert req.text is not None
        self._check_length("text", len(req.text))
        return self.tokenizer(req.text).input_ids

    def _check_ids(self, field: str, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field} holds {bad}, outside the vocabulary [0, {self.vocab_size})")

    def _check_length(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise PromptTooLong(
                f"{field} has {chars} characters: more than the context length's tokens can "
                f"hold ({self.max_prompt_chars})"
            )

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
