"""A fast, deterministic stand-in for the model worker, for scheduler tests.

Its "KV cache" stores each token's id in the token's slot. The next token of a sequence is a hash
of the whole sequence as read back through kv_slots, so a wrong slot, a lost chunk, a stale KV
entry or a wrong position changes the output, and `reference_tokens` gives what batching,
chunking and retraction must never change.
"""

from __future__ import annotations

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput

VOCAB = 1000
EOS = 0


def next_token(tokens: list[int]) -> int:
    h = 17
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS: requests stop by length unless a test says otherwise


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class FakeModelWorker:
    def __init__(self, num_slots: int):
        self.kv = torch.full((num_slots + 1,), -1, dtype=torch.int64)  # slot 0: padding
        self.batches: list[ModelWorkerBatch] = []

    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        self.batches.append(batch)
        assert (batch.out_cache_loc > 0).all(), "slot 0 is padding, never a token's home"
        self.kv[batch.out_cache_loc] = batch.input_ids
        seq_lens = batch.seq_lens.tolist()
        out, start = [], 0
        for i, (prefix, extend) in enumerate(
            zip(batch.prefix_lens.tolist(), batch.extend_lens.tolist())
        ):
            expected = torch.arange(prefix, prefix + extend)
            assert torch.equal(batch.positions[start : start + extend], expected), "positions"
            start += extend
            slots = batch.kv_slots[i, : seq_lens[i]]
            assert (batch.kv_slots[i, seq_lens[i] :] == 0).all(), "padding must be slot 0"
            tokens = self.kv[slots].tolist()
            assert -1 not in tokens, "a sequence reads a slot nobody wrote"
            out.append(next_token(tokens))
        return SampleOutput(torch.tensor(out, dtype=torch.int64))
