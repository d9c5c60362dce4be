"""Prompts to token ids: raw text, a chat conversation through the model's template, or ids."""

from __future__ import annotations

from transformers import AutoTokenizer

from protocol.wire import GenerateRequest, SamplingParams

# Sampling features the wire format names but this server does not implement yet: refusing them
# beats silently ignoring them.
_NOT_YET_SUPPORTED = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                      "stop", "seed", "n")
_DEFAULTS = SamplingParams()


class Tokenization:
    def __init__(self, model_path: str, vocab_size: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = vocab_size

    def input_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            bad = next((t for t in req.input_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})"
                )
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

    @staticmethod
    def check_supported(req: GenerateRequest) -> None:
        params = req.sampling_params
        for name in _NOT_YET_SUPPORTED:
            if getattr(params, name) != getattr(_DEFAULTS, name):
                raise ValueError(f"sampling_params.{name} is not supported yet")
        if req.return_logprob or req.top_logprobs_num:
            raise ValueError("return_logprob is not supported yet")
