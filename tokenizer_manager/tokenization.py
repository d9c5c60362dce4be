"""Prompts to token ids: raw text, a chat conversation through the model's template, or ids.

Tokenizing runs off the event loop, on two lanes of one worker thread each: prompts longer than
LONG_PROMPT_CHARS queue on one, the others on the other. A prompt near the context's length
(seconds in the tokenizer) then delays only other long prompts, never a short one, nor the
streams already running (the tokenizer releases the GIL while it works). Each lane has its own
tokenizer: one is not safe to call from two threads at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2
import msgspec
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.detokenizer.tokenizer_handoff import decoder_for
from radixserve.protocol.reasoning_tags import think_tags
from radixserve.protocol.wire import (
    MAX_STOP_TOKEN_IDS,
    GenerateRequest,
    SamplingParams,
    check_in_vocabulary,
)

# Tens of milliseconds of tokenizing at most: the short lane stays quick for all queued on it.
LONG_PROMPT_CHARS = 32_768


class PromptTooLong(ValueError):
    pass


class _Lane:
    """One worker thread, and the tokenizer that only it calls."""

    def __init__(self, model_path: str, name: str, tokenizer: PreTrainedTokenizerBase | None):
        self._model_path = model_path
        self._tokenizer = tokenizer
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}")

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """On the lane's thread only. The long lane loads its own at its first prompt (a second
        at start would cost every server a second's load, and most never see a long prompt)."""
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        return self._tokenizer


class Tokenization:
    def __init__(self, model_path: str, vocab_size: int, context_len: int):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if len(tokenizer) < 2:  # transformers builds an empty one where the files are missing
            raise ValueError(
                f"{model_path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): "
                "every prompt would be no tokens"
            )
        self.loaded = tokenizer  # the short lane's: called from its thread once serving
        self._short = _Lane(model_path, "short", tokenizer)
        # Texts of ids (logprob tokens, an echoed prompt) as the detokenizer decodes them, with
        # no clean-up: on the short lane, whose tokenizer it wraps.
        self._decoder = decoder_for(tokenizer)
        self._long = _Lane(model_path, "long", None)
        self.vocab_size = vocab_size
        # No token stands for more characters than its own spelling has, so a text longer than
        # this cannot fit the context: it is refused before the tokenizer spends seconds on it.
        longest_token = max(map(len, tokenizer.get_vocab()))
        self.max_prompt_chars = context_len * longest_token
        self.think_tags = think_tags(tokenizer)  # a reasoning model's, as the scheduler's
        self._special_ids = {  # within the model's rows: an id past them would index nothing
            token.content: token_id
            for token_id, token in tokenizer.added_tokens_decoder.items()
            if token.special and token_id < vocab_size
        }

    def with_special_stops(self, params: SamplingParams) -> SamplingParams:
        """`params` with its stop strings that are a special token's text (`<|im_end|>`) as
        stop token ids too: with skip_special_tokens on, that text never reaches the
        detokenizer's matcher, so they would never match (SGLang matches them; vLLM does not).
        Within the wire's bound on stop token ids."""
        if not params.skip_special_tokens or not params.stop:
            return params
        extra = [self._special_ids[s] for s in params.stop if s in self._special_ids]
        ids = list(dict.fromkeys([*params.stop_token_ids, *extra]))  # a set: repeats say nothing
        if ids == params.stop_token_ids:
            return params
        return msgspec.structs.replace(params, stop_token_ids=ids[:MAX_STOP_TOKEN_IDS])

    async def input_ids_async(self, req: GenerateRequest) -> list[int]:
        lane = self._long if _prompt_size(req) > LONG_PROMPT_CHARS else self._short
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            lane.worker, lambda: self.input_ids(req, lane.tokenizer())
        )

    async def token_texts_async(self, ids: list[int]) -> list[str]:
        """Each token's own text (OpenAI's logprobs name tokens so), on the short lane."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._short.worker, self._token_texts, ids)

    def _token_texts(self, ids: list[int]) -> list[str]:
        return self._decoder.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def input_ids(self, req: GenerateRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The prompt's token ids; ValueError naming the field for ids outside the vocabulary,
        PromptTooLong for a text that cannot fit the context."""
        self._check_ids("sampling_params.stop_token_ids", req.sampling_params.stop_token_ids)
        self._check_ids("sampling_params.logit_bias", req.sampling_params.logit_bias)
        if req.input_ids is not None:
            self._check_ids("input_ids", req.input_ids)
            return req.input_ids
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            return self.chat_ids(tokenizer, messages)
        assert req.text is not None
        self._check_length("text", len(req.text))
        return tokenizer(req.text).input_ids

    def chat_ids(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """A conversation's ids through the model's chat template, which also reads the tools
        and any extra variables (chat_template_kwargs, e.g. enable_thinking)."""
        if tokenizer.chat_template is None:
            raise ValueError("messages: this model has no chat template; send text")
        self._check_length("messages", _chat_size(messages))
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except (jinja2.TemplateError, TypeError) as e:
            # Its raise_exception (roles out of order, say), or a variable of the wrong type.
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None
        # The template already wrote the special tokens (BOS, role markers).
        return tokenizer(text, add_special_tokens=False).input_ids

    async def chat_ids_async(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """`chat_ids` on the lane its size picks (the OpenAI API's chat, whose messages and
        tools the wire's do not carry)."""
        lane = self._long if _chat_size(messages) > LONG_PROMPT_CHARS else self._short
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            lane.worker,
            lambda: self.chat_ids(lane.tokenizer(), messages, tools, template_kwargs),
        )

    async def decode_async(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept (a prompt's, echoed)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._short.worker,
            lambda: self._decoder.decode_batch([ids], skip_special_tokens=False)[0],
        )

    def _check_ids(self, field: str, ids: Iterable[int]) -> None:
        check_in_vocabulary(field, ids, self.vocab_size)

    def _check_length(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise PromptTooLong(
                f"{field} has {chars} characters: more than the context length's tokens can "
                f"hold ({self.max_prompt_chars})"
            )

    def close(self) -> None:
        for lane in (self._short, self._long):
            lane.worker.shutdown(wait=False, cancel_futures=True)


def _chat_size(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"] or "") for m in messages)


def _prompt_size(req: GenerateRequest) -> int:
    """Characters of text, or ids to check: what the prompt costs its lane."""
    if req.input_ids is not None:
        return len(req.input_ids)
    if req.messages is not None:
        return sum(len(m.content) for m in req.messages)
    return len(req.text or "")
