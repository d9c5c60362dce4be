"""The client wire format (see docs: WIRE.md): one msgpack map per ZMQ frame, `type` picks the kind.

Requests are decoded straight into these structs, so a map of the wrong shape, an unknown key or
an out-of-range value fails in the decoder with a message that names the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from radixserve.protocol.schema_keywords import unenforced_keyword

# Bounds on what a client controls. Integers that become int64 tensor entries must fit one (a
# seed of 2**63 once killed the scheduler); counts and lengths past these are mistakes or attacks.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # completions of one request (OpenAI's limit)
MAX_TOP_K = 2**31 - 1  # any k past the vocabulary keeps every token
# The sampler holds these as 32-bit floats: past the bound a temperature was infinite, and a
# repetition penalty or top_p under it was 0 (a logit divided by it infinite); each drew the same
# token whatever the seed.
MAX_TEMPERATURE = 1_000_000
MIN_FRACTION = 1e-6  # top_p's and repetition_penalty's least
MAX_TOP_LOGPROBS = 256
# Top logprobs of a prompt in all (its tokens scored x top_logprobs_num): each is held as a Python
# pair, about 100 bytes, from the scheduler to the reply. vLLM's 20 a position over a 32k
# context fit; 256 a position over a long prompt (25M pairs at 100k tokens) does not.
MAX_PROMPT_TOP_LOGPROBS = 1 << 20
# The same bound on an output's (its max_new_tokens x top_logprobs_num): the scheduler keeps
# every position's list until the request ends, and a whole reply carries them all.
MAX_OUTPUT_TOP_LOGPROBS = 1 << 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_RID_CHARS = 256
MAX_API_KEY_CHARS = 256
# The API key's environment variable, read by the server (--api-key's default) and the clients:
# a key on a command line shows in ps.
API_KEY_ENV = "RADIXSERVE_API_KEY"
# Lists are bounded in their types, so that the decoder refuses one by its length alone, before
# it builds millions of objects.
MAX_INPUT_IDS = 1 << 20  # past any context length served here
MAX_MESSAGES = 4096
# A grammar spec (json_schema, regex or ebnf) in UTF-8 bytes: compiling one costs time and memory
# that grow with it, on the scheduler's compile threads.
MAX_GRAMMAR_BYTES = 128 * 1024
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")

StopStrings = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
    msgspec.Meta(max_length=MAX_STOP_STRINGS),
]
StopTokenIds = Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
# SGLang's clients send these with every request; accepted only with the value that asks for
# nothing this server lacks (a list of regexes to stop at: none).
NoStopRegex = Annotated[list[str], msgspec.Meta(max_length=0)]
LogitBias = Annotated[
    dict[int, Annotated[float, msgspec.Meta(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]],
    msgspec.Meta(max_length=MAX_LOGIT_BIAS),
]
GrammarSpec = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_BYTES)]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: StopStrings = []
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    # EOS and the stop tokens cannot be drawn before this many new tokens (SGLang's name).
    min_new_tokens: int = 0
    logit_bias: LogitBias = {}  # token id -> added to its logit before penalties
    # Constrained decoding (SGLang's names), at most one: the output follows a JSON schema (a
    # JSON text), a regular expression, or an EBNF grammar (xgrammar's dialect, root rule `root`).
    json_schema: GrammarSpec | None = None
    regex: GrammarSpec | None = None
    ebnf: GrammarSpec | None = None
    # SGLang's names and no-ops, which its clients send (bench_serving, RuntimeEndpoint).
    sampling_seed: int | None = None  # SGLang's name for seed
    spaces_between_special_tokens: bool = True  # only true (checked below)
    no_stop_trim: bool = False  # only false
    stop_regex: NoStopRegex | None = None

    def __post_init__(self) -> None:
        # Plain bools checked here: msgspec takes Literal[True] only from 0.22 on.
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens must be true: nothing else is served")
        if self.no_stop_trim:
            raise ValueError("no_stop_trim must be false: the text always ends before a stop")
        if self.sampling_seed is not None:
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError("seed and sampling_seed (SGLang's name for it) disagree")
            self.seed, self.sampling_seed = self.sampling_seed, None
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (
                0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be in [0, {MAX_TEMPERATURE}]",
            ),
            (MIN_FRACTION <= self.top_p <= 1, "top_p must be in [1e-6, 1]"),
            (
                self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K,
                f"top_k must be -1 (off) or in [1, {MAX_TOP_K}]",
            ),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                MIN_FRACTION <= self.repetition_penalty <= 2,
                "repetition_penalty must be in [1e-6, 2]",
            ),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]"),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens must be in [0, max_new_tokens]",
            ),
            (
                self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                "seed must fit in 64 bits: [-2**63, 2**63 - 1]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.grammar is not None:
            check_grammar(*self.grammar)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, spec) of the request's grammar, None when unconstrained. ValueError names the
        fields when more than one is given."""
        given = [(f, getattr(self, f)) for f in GRAMMAR_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(
                f"only one of json_schema, regex, ebnf may be given, not {given[0][0]} "
                f"and {given[1][0]}"
            )
        return given[0] if given else None

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
    # No "tool": the wire format has no tools, tool calls or tool_call_id, so a tool message
    # could answer no call, and a template that does not know the role (SmolLM2's) would
    # render it as a marker the model never saw. Adding it with tool calls is additive.
    role: Literal["system", "user", "assistant"]
    content: str


class _Request(
    msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True, kw_only=True
):
    # Checked on every request when the server runs with --api-key; ignored otherwise.
    api_key: Annotated[str, msgspec.Meta(max_length=MAX_API_KEY_CHARS)] | None = None


class GenerateRequest(_Request, tag="generate"):
    rid: str | None = None
    text: str | None = None
    input_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_INPUT_IDS)] | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # SGLang's: with return_logprob, the logprobs of the prompt's tokens from this position on
    # (input_token_logprobs); -1: none. The prompt is then computed whole, never from the cache.
    logprob_start_len: int = -1
    # SGLang's, which its clients send: accepted where they ask for nothing this server lacks
    # (no LoRA, no image, no session, no custom logit processor, logprobs without their texts).
    lora_path: None = None
    image_data: None = None
    session_params: None = None
    custom_logit_processor: None = None
    return_text_in_logprobs: bool = False  # only false (checked below)
    log_metrics: bool = True  # false: /metrics and --log-requests' finish lines leave it out

    def __post_init__(self) -> None:
        if self.return_text_in_logprobs:
            raise ValueError("return_text_in_logprobs must be false: logprobs come as pairs")
        given = [f for f in ("text", "input_ids", "messages") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of text, input_ids or messages is required")
        if not (self.text or self.input_ids or self.messages):
            raise ValueError(f"{given[0]} must not be empty")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.logprob_start_len < -1:
            raise ValueError("logprob_start_len must be -1 (none) or a prompt position")
        check_rid(self.rid)


class AbortRequest(_Request, tag="abort"):
    rid: str

    def __post_init__(self) -> None:
        check_rid(self.rid)


def check_grammar(field: str, spec: str) -> None:
    """What can be checked of a grammar spec without compiling it: its size, and that a JSON
    schema is JSON and uses no keyword the grammar would not enforce. The rest (a schema the
    compiler refuses, a bad regex) is found by the scheduler's compile, which answers with an
    error naming the field as well."""
    if len(spec.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{field} must be at most {MAX_GRAMMAR_BYTES} bytes")
    if field == "json_schema":
        try:
            schema = msgspec.json.decode(spec)
        except msgspec.DecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:  # a string field's JSON: the request's decoder never saw it
            raise ValueError("json_schema is nested too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object (a schema)")
        unenforced = unenforced_keyword(schema)
        if unenforced is not None:
            raise ValueError(f"json_schema: {unenforced}")


def check_prompt_top_logprobs(field: str, top: int, prompt_tokens: int) -> None:
    """`top` top logprobs for each of `prompt_tokens` prompt tokens fit MAX_PROMPT_TOP_LOGPROBS
    (ValueError naming `field`, the client's name for `top`)."""
    if top * prompt_tokens > MAX_PROMPT_TOP_LOGPROBS:
        raise ValueError(
            f"{field}: {top} top logprobs for each of the prompt's {prompt_tokens} tokens make "
            f"{top * prompt_tokens}; at most {MAX_PROMPT_TOP_LOGPROBS} in all (ask for fewer, or "
            "for a shorter part of the prompt)"
        )


def check_output_top_logprobs(
    field: str, top: int, new_tokens: int, length_field: str, completions: int = 1
) -> None:
    """`top` top logprobs for each of up to `new_tokens` output tokens of each of `completions`
    fit MAX_OUTPUT_TOP_LOGPROBS (ValueError naming `field`; `length_field`: the client's name
    for the output's limit)."""
    total = top * new_tokens * completions
    if total > MAX_OUTPUT_TOP_LOGPROBS:
        each = "" if completions == 1 else f" of each of {completions} completions"
        raise ValueError(
            f"{field}: {top} top logprobs for each of up to {new_tokens} new tokens{each} make "
            f"{total}; at most {MAX_OUTPUT_TOP_LOGPROBS} in all (ask for fewer, or for a smaller "
            f"{length_field})"
        )


def check_in_vocabulary(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """ValueError naming `field` for an id outside [0, vocab_size) (the model's embedding rows)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field} holds {bad}, outside the vocabulary [0, {vocab_size})")


def check_rid(rid: str | None) -> None:
    # A rid travels in every step's messages and every reply: keep it short.
    if rid is not None and len(rid) > MAX_RID_CHARS:
        raise ValueError(f"rid must be at most {MAX_RID_CHARS} characters")


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
    # With logprob_start_len, on the final reply: the prompt's tokens from it on. The prompt's
    # first token has no logprob (None), nor top tokens ([]).
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    id: str = ""  # the request's rid, where SGLang's clients read it


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
    code: str  # invalid_request|unauthorized|too_long|not_found|not_ready|overloaded|internal
    message: str
    rid: str | None = None


class HealthReply(_Reply, tag="health"):
    status: str  # "ok"; no default, so that it is on the wire (replies omit defaults)


# Its defaults sent too: SGLang's clients read is_generation and tokenizer_path.
class ModelInfoReply(_Reply, tag="model_info", omit_defaults=False):
    model_path: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    is_generation: bool = True
    tokenizer_path: str = ""  # the model's directory, whose tokenizer the server loads


# Its defaults sent too: a replica's dp_rank 0 and a count still 0 are figures, not absences.
class ServerInfoReply(_Reply, tag="server_info", omit_defaults=False):
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
    prompt_tokens: int = 0  # prompt tokens received (the hit rate's denominator)
    dp_rank: int = 0  # the replica these figures are of (with replicas, 0 for the sum)
    # With --dp-size above 1: each replica's own figures, in order; the fields above sum them.
    replicas: list[ServerInfoReply] = []
    num_requests: int = 0  # generates received (completions: n counts n)
    # Speculative decoding: requests' steps that verified drafts, drafts proposed, accepted.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_accept_length(self) -> float:
        """Tokens a verifying request step gained on average (SGLang's accept length); 0
        before any."""
        if not self.spec_verifies:
            return 0.0
        return 1 + self.spec_accepted_tokens / self.spec_verifies


class FlushCacheReply(_Reply, tag="flush_cache"):
    success: bool
    message: str = ""


ServerReply = (
    OutputReply | ErrorReply | HealthReply | ModelInfoReply | ServerInfoReply | FlushCacheReply
)
