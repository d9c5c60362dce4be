"""SamplingRows: each running request's sampling parameters, kept in its ReqToTokenPool row.

Written once when a request is given a row; a step gathers its batch's columns with one index per
dtype, so building SamplingBatchInfo costs no Python per request (but per penalised request, whose
seen tokens the batch carries).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.model_worker.batch import LogitBias, PenaltyTokens, SamplingBatchInfo
from radixserve.model_worker.sampler import GREEDY_TEMPERATURE
from radixserve.scheduler.grammar import grammar_decides_end
from radixserve.scheduler.req import Req
from radixserve.scheduler.seen_tokens import SeenTokens, penalty_tokens

# Column order of each table.
FLOATS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
INTS = ("top_k", "seed", "top_logprobs_num")
FLAGS = ("seeded", "return_logprob", "penalized", "greedy", "biased")


class SamplingRows:
    def __init__(self, num_rows: int):
        self.floats = np.zeros((num_rows, len(FLOATS)), np.float32)
        self.ints = np.zeros((num_rows, len(INTS)), np.int64)
        self.flags = np.zeros((num_rows, len(FLAGS)), np.bool_)

    def write(self, row: int, req: Req) -> None:
        p = req.sampling_params
        self.floats[row] = (
            p.temperature,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        self.ints[row] = (p.top_k, p.seed or 0, req.top_logprobs_num)
        greedy = p.is_greedy or p.temperature < GREEDY_TEMPERATURE
        biased = bool(p.logit_bias) or p.min_new_tokens > 0
        self.flags[row] = (p.seed is not None, req.return_logprob, p.has_penalties, greedy, biased)

    def batch_info(
        self, reqs: list[Req], rows: torch.Tensor, output_index: torch.Tensor
    ) -> SamplingBatchInfo:
        """The columns of the batch whose sequence i is reqs[i], in row rows[i]."""
        index = rows.numpy()
        floats = torch.from_numpy(self.floats[index].T.copy())
        ints = torch.from_numpy(self.ints[index].T.copy())
        flags = self.flags[index].T.copy()
        seeded, return_logprob, _, _, _ = torch.from_numpy(flags)
        temperatures, top_ps, min_ps, rep, freq, pres = floats
        top_ks, seeds, top_logprobs_nums = ints
        return SamplingBatchInfo(
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            seeds=seeds,
            seeded=seeded,
            output_index=output_index,
            top_logprobs_nums=top_logprobs_nums,
            return_logprob=return_logprob,
            penalty_tokens=_penalty_tokens(reqs, flags[2]) if flags[2].any() else None,
            is_all_greedy=bool(flags[3].all()),
            any_logprob=bool(flags[1].any()),
            logit_bias=_logit_bias(reqs, flags[4], output_index),
        )


def _penalty_tokens(reqs: list[Req], penalised: np.ndarray) -> PenaltyTokens:
    """The seen tokens of the requests whose `penalised` flag is set, for the batch."""
    indices = np.flatnonzero(penalised)
    seen: list[SeenTokens] = []
    future_ids: list[list[int]] = []
    for i in indices.tolist():
        req_seen = reqs[i].seen
        assert req_seen is not None, "a request with penalties has seen its prompt"
        seen.append(req_seen)
        future_ids.append(reqs[i].future_ids)
    return penalty_tokens(indices, seen, future_ids)


def _logit_bias(
    reqs: list[Req], biased: np.ndarray, output_index: torch.Tensor
) -> LogitBias | None:
    """The biases of the requests whose `biased` flag is set: their logit_bias, and -inf on
    their stop tokens (EOS unless ignore_eos, and stop_token_ids) for a row that samples an
    output before min_new_tokens, unless a grammar decides where it ends (its mask may allow
    nothing but EOS: masked too, the row would have no token left). None: no entry, so the
    sampler keeps its fast paths once every minimum is reached."""
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i in np.flatnonzero(biased).tolist():
        req = reqs[i]
        params = req.sampling_params
        rows += [i] * len(params.logit_bias)
        token_ids += params.logit_bias.keys()
        biases += params.logit_bias.values()
        if int(output_index[i]) < params.min_new_tokens and not grammar_decides_end(req):
            rows += [i] * len(req.stop_token_ids)
            token_ids += req.stop_token_ids
            biases += [float("-inf")] * len(req.stop_token_ids)
    if not rows:
        return None
    return LogitBias(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(token_ids, dtype=torch.int64),
        torch.tensor(biases, dtype=torch.float32),
    )
