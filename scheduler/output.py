"""Output framing: what a step hands the detokenizer for each request (ReqTokenOut; ReqStart once,
with its first), and the logprobs each real output token keeps."""

from __future__ import annotations

from radixserve.model_worker.batch import SampleOutput
from radixserve.protocol.internal import Logprob, PromptLogprob, ReqStart, ReqTokenOut
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch


def next_output(req: Req) -> ReqTokenOut:
    """Req's outputs since its previous one, with its counters; its first output also carries
    what stays the same for its whole life (ReqStart). They count as sent from now on
    (`num_sent_tokens`, which only this writes)."""
    sent = req.num_sent_tokens
    outputs = req.output_ids
    req.num_sent_tokens = len(outputs)
    # Every output but a request's final one carries a new token, and a retracted request keeps
    # its outputs: so nothing was sent for it before exactly when `sent` is 0.
    start = _start(req) if sent == 0 else None
    # Positional arguments: this runs for every streaming request on every step.
    return ReqTokenOut(
        req.rid,
        outputs[sent:],
        req.finished_reason,
        len(outputs),
        start,
        req.output_token_logprobs[sent:] if req.return_logprob else None,
        req.output_top_logprobs[sent:] if req.top_logprobs_num else None,
        *_prompt_logprobs(req),
    )


def _prompt_logprobs(
    req: Req,
) -> tuple[list[PromptLogprob], list[list[Logprob]] | None] | tuple[()]:
    """A final output's prompt logprobs, when the request asked for them."""
    if req.logprob_start_len < 0 or req.finished_reason is None:
        return ()
    return req.input_token_logprobs, req.input_top_logprobs if req.top_logprobs_num else None


# Prompt ids the detokenizer decodes an output after (vLLM's first prefix offset).
DETOKENIZE_CONTEXT = 5


def _start(req: Req) -> ReqStart:
    params = req.sampling_params
    prompt = req.origin_input_ids
    return ReqStart(
        len(prompt),
        req.cached_tokens,
        params.skip_special_tokens,
        params.stop,
        prompt[-DETOKENIZE_CONTEXT:],
        params.min_new_tokens,
    )


class LogprobRows:
    """A step's logprobs, as Python lists: each real output token keeps its row's, for requests
    that asked for them."""

    def __init__(self, result: SampleOutput):
        assert result.token_logprobs is not None
        self.tokens = result.next_token_ids.tolist()
        self.token_logprobs = result.token_logprobs.tolist()
        self.top_values = result.top_logprobs.tolist() if result.top_logprobs is not None else []
        self.top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else []

    def record(self, req: Req, i: int) -> None:
        """Req's new output token is the result's token i."""
        req.output_token_logprobs.append((self.token_logprobs[i], self.tokens[i]))
        if req.top_logprobs_num:
            k = req.top_logprobs_num
            req.output_top_logprobs.append(list(zip(self.top_values[i][:k], self.top_ids[i][:k])))


def record_prompt_logprobs(batch: ScheduleBatch, result: SampleOutput) -> None:
    """Keep the logprobs of the prompt tokens the step's prompt spans predicted, in order: a
    recompute after a retraction predicts some again, and they are kept once."""
    assert result.prompt_logprobs is not None and result.prompt_top_logprobs is not None
    assert result.prompt_top_logprob_ids is not None
    values = result.prompt_logprobs.tolist()
    top_values = result.prompt_top_logprobs.tolist()
    top_ids = result.prompt_top_logprob_ids.tolist()
    at = 0
    for i, first, count in batch.prompt_spans:
        req = batch.reqs[i]
        prompt, k = req.origin_input_ids, req.top_logprobs_num
        for j in range(at, at + count):
            token = first + 1 + j - at  # the prompt position this row predicts
            if token == req.logprob_start_len + len(req.input_token_logprobs):
                req.input_token_logprobs.append((values[j], prompt[token]))
                req.input_top_logprobs.append(list(zip(top_values[j][:k], top_ids[j][:k])))
        at += count
