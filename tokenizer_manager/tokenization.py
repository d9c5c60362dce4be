"""Prompts to token ids: raw text, a chat conversation through the model's template, or ids."""

from __future__ import annotations

from transformers import AutoTokenizer

from radixserve.protocol.wire import GenerateRequest


class Tokenization:
    def __init__(self, model_path: str, vocab_size: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = vocab_size

    def input_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids; ValueError naming the field for ids outside the vocabulary."""
        self._check_ids("sampling_params.stop_token_ids", req.sampling_params.stop_token_ids)
        if req.input_ids is not None:
            self._check_ids("input_ids", req.input_ids)
            return req.input_ids
        if req.messages is not None:
            if self.tokenizer.chat_template is None:
                raise ValueError("messages: this model has no chat template; send text")
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            # The template already wrote the special tokens (BOS, role markers).
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(req.text).input_ids

    def _check_ids(self, field: str, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field} holds {bad}, outside the vocabulary [0, {self.vocab_size})")
