"""DraftModel: STANDALONE speculative decoding's small model, proposing a chain of drafts.

It lives in the model process beside the target model, with its own weights and its own KV pool,
but its pool has as many slots as the target's and is addressed by the SAME slots: whatever the
target writes at a step's out_cache_loc, the draft writes there too, over the same tokens (prefill
chunks, decodes, verified drafts). So the scheduler's allocator, req_to_token and radix cache
serve both models unchanged, and a prefix hit is a hit for the draft as well (as SGLang's draft
worker shares the target's allocator). The scheduler knows nothing of the draft model: it
allocates a speculating request's K + 1 slots as for NGRAM, with placeholder drafts that
`prepare` overwrites.

Which positions hold draft KV. Let a request's last token t sit at position p (its KV not yet
written by either model). A step that speculates K drafts for it runs K + 1 draft passes:
    pass 1      the step's batch without its drafts: t at p (prefills and plain decodes beside it
                have all their rows here)                         -> d_1 = argmax
    pass j + 1  d_j at p + j, for j = 1 .. K                      -> d_{j+1} = argmax (j < K)
so the draft writes p .. p + K, exactly the slots the target's verify writes. The target accepts
a drafts (0 <= a <= K) and samples one more token: positions p .. p + a hold the real tokens t,
d_1 .. d_a in both pools; p + a + 1 .. p + K are freed (junk in both, never read); the new last
token sits at p + a + 1 with no KV in either, as after any step. A step that does not speculate
runs the draft over all its rows too (one pass, no logits), or the draft's KV would have holes
where the target's has none. Greedy drafts (argmax) are a point-mass proposal: spec_verify's
rejection sampling keeps the target's distribution exactly at any temperature.

Only one TP rank: every rank would have to draft the very same tokens (server_args refuses
STANDALONE with --tp-size above 1).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.kv_pool import TokenToKVPool
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.model_loading import load_model
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.spec_verify import draft_rows

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(
        self,
        draft_path: str,
        *,
        target_path: str,
        target: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        kernels: str,
        quantization: str | None,
        fused_layers: bool,
    ):
        """The draft's weights, loaded once its vocabulary is known to be the target's."""
        check_same_vocabulary(target_path, target, draft_path, ModelConfig.from_dir(draft_path))
        loaded = load_model(
            draft_path, dtype, device, TPGroup(), kernels, quantization, fused_layers
        )
        if loaded.config.max_position_embeddings < target.max_position_embeddings:
            logger.warning(
                "the draft model %s was trained on %d positions, the model on %d: its drafts "
                "past that are likely rejected more often (the outputs stay the model's)",
                draft_path,
                loaded.config.max_position_embeddings,
                target.max_position_embeddings,
            )
        self.loaded = loaded
        self.narrower = loaded.config.vocab_size < target.vocab_size  # than the target's
        self.dtype = dtype
        self.device = device
        config = loaded.config
        self.weight_bytes = loaded.weight_bytes
        self.kv_slot_bytes = TokenToKVPool.bytes_per_slot(
            config.num_hidden_layers, loaded.num_kv_heads, config.head_dim, dtype
        )
        self.kv_pool: TokenToKVPool | None = None  # sized with the target's (allocate_kv)

    def allocate_kv(self, num_slots: int) -> None:
        config = self.loaded.config
        self.kv_pool = TokenToKVPool(
            num_slots,
            config.num_hidden_layers,
            self.loaded.num_kv_heads,
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def prepare(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """Run the draft over the step: its KV for every row the target computes, and for a
        speculating batch the drafts, written over the scheduler's placeholders."""
        if batch.draft_lens is None:
            self._hidden(batch)  # its KV only: nothing to propose
            return batch
        return replace(batch, input_ids=self._propose(batch, batch.draft_lens))

    def _propose(self, batch: ModelWorkerBatch, draft_lens: torch.Tensor) -> torch.Tensor:
        """The batch's input ids with each speculating sequence's drafts in place."""
        extend = batch.extend_lens
        starts = torch.cumsum(extend, 0) - extend
        placeholders = draft_rows(extend, draft_lens)
        undrafted = torch.ones(batch.input_ids.numel(), dtype=torch.bool)
        undrafted[placeholders] = False
        first = _step(
            batch,
            input_ids=batch.input_ids[undrafted],
            positions=batch.positions[undrafted],
            out_cache_loc=batch.out_cache_loc[undrafted],
            prefix_lens=batch.prefix_lens,
            extend_lens=extend - draft_lens,
        )
        hidden, last_rows = self._hidden(first)
        width = int(draft_lens.max())
        drafts = torch.zeros(draft_lens.numel(), width, dtype=torch.int64)
        drafting = (draft_lens > 0).nonzero()[:, 0]
        drafts[drafting, 0] = self._argmax(hidden[last_rows[drafting]])
        # A speculating sequence's extend rows are its last token (at prefix_lens) and then its
        # drafts: draft j sits at prefix_lens + j, in slot out_cache_loc[starts + j].
        for j in range(1, width + 1):
            seqs = (draft_lens >= j).nonzero()[:, 0]
            positions = batch.prefix_lens[seqs] + j
            one_row = _step(
                batch,
                input_ids=drafts[seqs, j - 1],
                positions=positions,
                out_cache_loc=batch.out_cache_loc[starts[seqs] + j],
                prefix_lens=positions,
                extend_lens=torch.ones_like(seqs),
                rows=seqs,
            )
            hidden, last_rows = self._hidden(one_row)
            more = draft_lens[seqs] > j  # the last pass only writes d_K's KV
            if bool(more.any()):
                drafts[seqs[more], j] = self._argmax(hidden[last_rows[more]])
        input_ids = batch.input_ids.clone()
        input_ids[placeholders] = drafts[torch.arange(width)[None, :] < draft_lens[:, None]]
        return input_ids

    def _hidden(self, batch: ModelWorkerBatch) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv_pool is not None, "allocate_kv first"
        if self.narrower:
            # An id past the draft's embedding is past the tokenizer too (a client's input_ids
            # may hold one): any row stands in for it; only the drafts' acceptance can change.
            vocab = self.loaded.config.vocab_size
            batch = replace(batch, input_ids=batch.input_ids.clamp(max=vocab - 1))
        return self.loaded.hidden_states(batch, self.kv_pool, self.device)

    def _argmax(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.loaded.model.compute_logits(hidden_rows).argmax(dim=-1).cpu()


def _step(
    batch: ModelWorkerBatch,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> ModelWorkerBatch:
    """A draft pass over some of the batch's sequences (`rows`; all by default) with these
    tokens and lengths. Each sequence's KV slots are cut at its new length: the slots past it
    (the drafts' that follow) are padding to this pass."""
    kv_slots = batch.kv_slots if rows is None else batch.kv_slots[rows]
    seq_lens = prefix_lens + extend_lens
    width = int(seq_lens.max())
    kv_slots = kv_slots[:, :width] * (torch.arange(width)[None, :] < seq_lens[:, None])
    return replace(
        batch,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        kv_slots=kv_slots,
        prompt_logprob_rows=None,
        prompt_logprob_targets=None,
        draft_lens=None,
    )


def check_same_vocabulary(
    target_path: str, target: ModelConfig, draft_path: str, draft: ModelConfig
) -> None:
    """A draft proposes token ids that the target verifies: both must mean the same tokens by
    them. Every id the draft proposes must be the target's: its embedding no wider (one family's
    sizes pad theirs differently, Qwen2.5's 0.5B to 151936 rows and its 7B to 152064); and where
    both directories have a tokenizer.json, its vocabulary and added tokens must match."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"the draft model {draft_path} has a vocabulary of {draft.vocab_size} tokens, the "
            f"model {target_path} of {target.vocab_size}: a draft model must share the model's "
            "tokenizer"
        )
    target_vocab, draft_vocab = _vocabulary(target_path), _vocabulary(draft_path)
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        raise ValueError(
            f"the draft model {draft_path} has another tokenizer than the model {target_path} "
            "(their tokenizer.json vocabularies differ): a draft model must share the model's "
            "tokenizer"
        )


def _vocabulary(model_path: str) -> tuple[Any, Any] | None:
    """tokenizer.json's token -> id map and its added tokens; None without that file."""
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    return data.get("model", {}).get("vocab"), added
