"""Req: one generation request as the scheduler sees it.

The vLLM v1 view: a request is `num_computed_tokens` (tokens whose KV is in the pool) racing
`num_tokens` (prompt + outputs so far). Far behind = prefill (maybe in chunks); one behind = decode.

    tokens:   [ prompt ........................ | outputs ...... ]
    KV:       [ tree's prefix | own ....... ]        ^ num_tokens
                              ^ prefix_len  ^ num_computed_tokens

The first `prefix_len` slots of its row belong to the radix tree (locked through `last_node` while
the request runs); the rest, up to `num_computed_tokens`, are the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.protocol.wire import FinishReason, SamplingParams
from radixserve.scheduler.radix_cache import TreeNode


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) plus the client's stop_token_ids
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    req_pool_idx: int | None = None  # row in ReqToTokenPool while it holds KV
    prefix_len: int = 0  # leading tokens whose KV slots the radix tree owns
    last_node: TreeNode | None = None  # the tree node ending at prefix_len, locked while running
    new_row: bool = False  # first step in its row: the worker (re)builds its penalty state
    finished_reason: FinishReason | None = None
    num_sent_tokens: int = 0  # outputs already handed to the detokenizer
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and bool(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def streams_steps(self) -> bool:
        """Whether its tokens go to the detokenizer every step: to stream them, or to let the
        detokenizer match stop strings while there is still something to stop."""
        return self.stream or bool(self.sampling_params.stop)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list."""
        n_in = len(self.origin_input_ids)
        if end <= n_in:
            return self.origin_input_ids[start:end]
        if start >= n_in:
            return self.output_ids[start - n_in : end - n_in]
        return self.origin_input_ids[start:] + self.output_ids[: end - n_in]

    def check_finished(self, last: int, context_len: int) -> None:
        """After a new output token `last`: stop token, max_new_tokens, or the context limit."""
        n_out = len(self.output_ids)
        if last in self.stop_token_ids:
            self.finished_reason = FinishReason("stop", last)
        elif (
            n_out >= self.sampling_params.max_new_tokens
            or len(self.origin_input_ids) + n_out >= context_len
        ):
            self.finished_reason = FinishReason("length")
