"""Messages between the server's own processes. One tagged union per receiving socket.

A `rid` here is the tokenizer manager's internal id of one completion, unique for the server's
lifetime; a client's own rid never leaves the tokenizer manager (tokenizer_manager/inflight.py).
"""

from __future__ import annotations

import msgspec

from radixserve.protocol.wire import FinishReason, ModelInfoReply, SamplingParams, ServerInfoReply


class _Msg(msgspec.Struct, tag_field="kind", array_like=True):
    pass


# ---- tokenizer manager -> scheduler ------------------------------------------------------------


class TokenizedGenerateReq(_Msg, tag="gen"):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position on; -1: none


class AbortReq(_Msg, tag="abort"):
    rid: str


class StopReq(_Msg, tag="stop"):
    """From the detokenizer: a stop string matched, so the request ends (finish reason stop)."""

    rid: str
    matched: str


class FlushCacheReq(_Msg, tag="flush"):
    query_id: int


class ServerInfoReq(_Msg, tag="info"):
    query_id: int


class HealthReq(_Msg, tag="health"):
    query_id: int


class ModelInfoReq(_Msg, tag="model_info"):
    """The scheduler answers: it resolved the dtype, device and context length."""

    query_id: int


SchedulerInput = (
    TokenizedGenerateReq
    | AbortReq
    | StopReq
    | FlushCacheReq
    | ServerInfoReq
    | HealthReq
    | ModelInfoReq
)

# (logprob, token id): SGLang's layout for output_token_logprobs and each top-logprobs entry.
Logprob = tuple[float, int]
# A prompt token's: the first token of a prompt has none.
PromptLogprob = tuple[float | None, int]


# ---- scheduler -> detokenizer ------------------------------------------------------------------


class ReqStart(msgspec.Struct, array_like=True):
    """What stays the same for a request's whole life, sent once: with its first output. The
    detokenizer keeps it from then until the request's final output."""

    prompt_tokens: int
    cached_tokens: int  # from its first admission (only a final output can come before it)
    skip_special_tokens: bool
    stop: list[str]  # stop strings, which the detokenizer matches
    # The prompt's last ids, which the output's first text is decoded after: a SentencePiece
    # tokenizer drops a sequence's first "▁", so "▁Paris" alone would lose its space.
    context: list[int] = []
    # A stop string ends the output only where it ends past this many tokens (vLLM's min_tokens).
    min_new_tokens: int = 0


class ReqTokenOut(msgspec.Struct, array_like=True):
    """The tokens one request produced since its previous output, and what changed with them."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    completion_tokens: int
    start: ReqStart | None = None  # on the request's first output only
    output_token_logprobs: list[Logprob] | None = None  # for new_token_ids, when asked for
    output_top_logprobs: list[list[Logprob]] | None = None
    # On the final output of a request with logprob_start_len: its prompt's logprobs.
    input_token_logprobs: list[PromptLogprob] | None = None
    input_top_logprobs: list[list[Logprob]] | None = None


class BatchTokenOut(_Msg, tag="tokens"):
    outs: list[ReqTokenOut]


# ---- detokenizer -> tokenizer manager ----------------------------------------------------------


class ReqStrOut(msgspec.Struct, array_like=True):
    rid: str
    text: str  # new text since the previous output, never half a UTF-8 character
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[Logprob] | None = None
    output_top_logprobs: list[list[Logprob]] | None = None
    input_token_logprobs: list[PromptLogprob] | None = None
    input_top_logprobs: list[list[Logprob]] | None = None


class BatchStrOut(_Msg, tag="strs"):
    outs: list[ReqStrOut]


# ---- scheduler -> tokenizer manager (control answers) ------------------------------------------


class ReqError(_Msg, tag="req_error"):
    rid: str
    code: str
    message: str


class ServerInfoOut(_Msg, tag="info_out"):
    query_id: int
    info: ServerInfoReply


class FlushCacheOut(_Msg, tag="flush_out"):
    query_id: int
    success: bool
    message: str


class HealthOut(_Msg, tag="health_out"):
    query_id: int


class ModelInfoOut(_Msg, tag="model_info_out"):
    query_id: int
    info: ModelInfoReply


class SchedulerReady(_Msg, tag="ready"):
    """A replica's model is loaded and its scheduler serves: the tokenizer manager takes
    generates once every replica (and the detokenizer) has said so. `max_total_tokens`: its KV
    pool, the most a request (prompt and output) can ever hold."""

    dp_rank: int
    max_total_tokens: int


class DetokenizerReady(_Msg, tag="detokenizer_ready"):
    """The detokenizer has its tokenizer and reads token ids: with a slow tokenizer (loaded
    through transformers, not handed over) it can be ready after the model is. Generates wait
    for it as for the replicas."""


class ReplicaLoad(_Msg, tag="load"):
    """A replica's load, for the data-parallel controller's router: the generates it has
    received so far, and those it holds now (waiting or running). The controller adds the ones
    it sent that the replica had not received yet."""

    dp_rank: int
    received: int
    in_flight: int


TokenizerManagerInput = (
    BatchStrOut
    | ReqError
    | ServerInfoOut
    | FlushCacheOut
    | HealthOut
    | ModelInfoOut
    | SchedulerReady
    | DetokenizerReady
)


# What replicas send the data-parallel controller: control answers to gather, and their load.
DpControllerInput = ServerInfoOut | FlushCacheOut | HealthOut | ModelInfoOut | ReplicaLoad


# ---- any child -> launch.py --------------------------------------------------------------------


class ProcessReady(msgspec.Struct, tag=True):
    name: str


class ProcessFailed(msgspec.Struct, tag=True):
    """A child's last word: why it stopped (its traceback is in its log at --log-level debug)."""

    name: str
    reason: str


LauncherInput = ProcessReady | ProcessFailed
