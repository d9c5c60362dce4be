"""Repetition, frequency and presence penalties, from per-request token counts kept on the worker.

State is keyed by the request's ReqToTokenPool row. A request's first step in a row carries a
PenaltyInit and the row is rebuilt from its tokens then; after that only each step's emitted
token is added, so no step re-reads or re-pads a request's history.
"""

from __future__ import annotations

import itertools

import torch

from model_worker.batch import PenaltyInit, SamplingBatchInfo


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits float32 [N, V], from raw logits [N, V], each row's output token counts
    (int32 [N, V]), prompt-token mask (bool [N, V]) and penalties (float32 [N]).

    Repetition as transformers' RepetitionPenaltyLogitsProcessor, on tokens of the prompt or the
    output: a positive logit is divided by it, any other multiplied. Then, as in OpenAI, vLLM and
    SGLang, frequency * count + presence * (count > 0) is subtracted for output tokens. Repetition
    goes first, as in vLLM, so it scales the model's logit rather than an already shifted one.
    """
    in_output = output_counts > 0
    rep = repetition[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(in_prompt | in_output, scaled, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def penalised_rows(info: SamplingBatchInfo) -> torch.Tensor:
    """Batch indices (int64, CPU) of the rows with any penalty."""
    on = (
        (info.repetition_penalties != 1)
        | (info.frequency_penalties != 0)
        | (info.presence_penalties != 0)
    )
    return on.nonzero()[:, 0]


class PenaltyState:
    """Per ReqToTokenPool row: how often each token appeared in the request's output, and whether
    it appeared in its prompt. Nothing is allocated until a penalised request appears, and the
    rows grow to cover the highest penalised row seen; unpenalised requests' rows are never read
    or written (a penalised request moving into one rebuilds it from its PenaltyInit)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    @property
    def num_rows(self) -> int:
        return self.output_counts.shape[0]

    def apply(
        self, logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor
    ) -> torch.Tensor:
        """The logits with penalties applied to batch rows `rows` (from `penalised_rows`), after
        rebuilding the state of those that start in their row. Returns a new tensor: the raw
        logits stay as they are, for logprobs."""
        if rows.numel() == 0:
            return logits
        device = logits.device
        pool_rows = info.req_rows[rows]
        self._ensure_rows(int(pool_rows.max()) + 1)
        starting = set(rows.tolist())
        self._rebuild([p for p in info.penalty_inits if p.batch_index in starting], info)
        pool_rows, rows_d = pool_rows.to(device), rows.to(device)
        penalised = apply_penalties(
            logits[rows_d],
            self.output_counts[pool_rows],
            self.in_prompt[pool_rows],
            info.repetition_penalties[rows].to(device),
            info.frequency_penalties[rows].to(device),
            info.presence_penalties[rows].to(device),
        )
        return logits.index_put((rows_d,), penalised)

    def record(self, tokens: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> None:
        """Count each sampled token (int64 [B], device) into its row's output counts, for the rows
        of `rows` whose token is kept: a prefill chunk's sample is discarded by the scheduler."""
        rows = rows[info.emits_token[rows]]
        if rows.numel() == 0:
            return
        device = tokens.device
        self.output_counts.index_put_(
            (info.req_rows[rows].to(device), tokens[rows.to(device)]),
            torch.ones(rows.numel(), dtype=torch.int32, device=device),
            accumulate=True,
        )

    def _ensure_rows(self, needed: int) -> None:
        if needed <= self.num_rows:
            return
        # Doubling: a server's rows fill up over its first requests, so copy log(rows) times.
        grow = max(needed, 2 * self.num_rows) - self.num_rows
        self.output_counts = torch.cat(
            [self.output_counts, self.output_counts.new_zeros(grow, self.output_counts.shape[1])]
        )
        self.in_prompt = torch.cat(
            [self.in_prompt, self.in_prompt.new_zeros(grow, self.in_prompt.shape[1])]
        )

    def _rebuild(self, inits: list[PenaltyInit], info: SamplingBatchInfo) -> None:
        """Reset the rows of `inits` to their prompt and outputs so far, in a few scatters."""
        if not inits:
            return
        device = self.output_counts.device
        pool_rows = info.req_rows[[p.batch_index for p in inits]]
        self.output_counts[pool_rows.to(device)] = 0
        self.in_prompt[pool_rows.to(device)] = False
        prompt_rows = _repeat(pool_rows, [len(p.prompt_ids) for p in inits], device)
        prompt_ids = _flat([p.prompt_ids for p in inits], device)
        self.in_prompt[prompt_rows, prompt_ids] = True
        output_rows = _repeat(pool_rows, [len(p.output_ids) for p in inits], device)
        output_ids = _flat([p.output_ids for p in inits], device)
        self.output_counts.index_put_(
            (output_rows, output_ids),
            torch.ones(output_ids.numel(), dtype=torch.int32, device=device),
            accumulate=True,
        )


def _repeat(values: torch.Tensor, counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(values, torch.tensor(counts, dtype=torch.int64)).to(device)


def _flat(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64).to(device)
