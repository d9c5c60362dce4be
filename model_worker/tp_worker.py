"""Tensor-parallel lockstep: rank 0's scheduler decides each step, every rank runs it.

Rank 0 broadcasts each step's ModelWorkerBatch (batch_codec's bytes, over torch.distributed)
before its own forward; the other ranks run the same batch, so the collectives inside the layers
pair up and every rank writes the same slots of its KV shard. Every rank samples from the same
gathered logits with a sampler seeded alike, so all pick the same token; rank 0's is used.
"""

from __future__ import annotations

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.model_worker.batch_codec import decode_batch, encode_batch
from radixserve.model_worker.model_runner import ModelRunner


class TpModelWorker:
    """The model worker of TP rank 0 (with a TP size of 1, the runner alone)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tp = runner.tp

    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        if self.tp.size > 1:
            self.tp.broadcast_bytes(encode_batch(batch))
        return self.runner.forward(batch)

    def keep_alive(self) -> None:
        """Tell the other ranks that rank 0 is alive but has nothing to run: they beat on it."""
        if self.tp.size > 1:
            self.tp.broadcast_bytes(b"")


def follow_rank0(runner: ModelRunner) -> None:
    """One step of a rank other than 0: wait for rank 0's next batch (or keep-alive), run it."""
    data = runner.tp.broadcast_bytes(None)
    if data:
        runner.forward(decode_batch(data))
