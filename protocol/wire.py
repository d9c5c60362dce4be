"""The client wire format (see docs: WIRE.md): one msgpack map per ZMQ frame, `type` picks the kind.

Requests are decoded straight into these structs, so a map of the wrong shape, an unknown key or
an out-of-range value fails in the decoder with a message that names the field.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.n >= 1, "n must be >= 1"),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class _Request(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    pass


class GenerateRequest(_Request, tag="generate"):
    rid: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0

    def __post_init__(self) -> None:
        given = [f for f in ("text", "input_ids", "messages") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of text, input_ids or messages is required")
        if not (self.text or self.input_ids or self.messages):
            raise ValueError(f"{given[0]} must not be empty")
        if self.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")


class AbortRequest(_Request, tag="abort"):
    rid: str


class HealthRequest(_Request, tag="health"):
    pass


class ModelInfoRequest(_Request, tag="model_info"):
    pass


class ServerInfoRequest(_Request, tag="server_info"):
    pass


class FlushCacheRequest(_Request, tag="flush_cache"):
    pass


ClientRequest = (
    GenerateRequest
    | AbortRequest
    | HealthRequest
    | ModelInfoRequest
    | ServerInfoRequest
    | FlushCacheRequest
)


# ---- replies -------------------------------------------------------------------------------


class FinishReason(msgspec.Struct):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None


class MetaInfo(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    e2e_latency: float
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None


class _Reply(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class OutputReply(_Reply, tag="output"):
    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    meta_info: MetaInfo
    index: int | None = None  # which of the n completions; present only when n > 1


class ErrorReply(_Reply, tag="error"):
    code: str  # invalid_request | too_long | not_found | overloaded | internal
    message: str
    rid: str | None = None


class HealthReply(_Reply, tag="health"):
    status: str = "ok"


class ModelInfoReply(_Reply, tag="model_info"):
    model_path: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    is_generation: bool = True


class ServerInfoReply(_Reply, tag="server_info"):
    running_requests: int
    waiting_requests: int
    kv_tokens_used: int
    kv_tokens_total: int
    cache_hit_rate: float
    gen_throughput: float  # tokens/s over the last log interval
    num_steps: int
    num_mixed_steps: int  # steps whose one forward held both prefill and decode work
    num_retractions: int
    num_evicted_tokens: int
    num_prefill_tokens: int  # prompt tokens computed (cache hits are not)
    max_running_requests: int


class FlushCacheReply(_Reply, tag="flush_cache"):
    success: bool
    message: str = ""


ServerReply = (
    OutputReply | ErrorReply | HealthReply | ModelInfoReply | ServerInfoReply | FlushCacheReply
)
