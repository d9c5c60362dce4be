"""OverlapWorker: runs a model worker's forwards on a thread of their own (overlap scheduling).

As SGLang's TpModelWorkerClient: the scheduler launches step N and, while it runs, processes
step N-1's result and plans step N+1. Torch releases the GIL inside its ops, so the scheduler's
Python runs while the model computes. One thread takes the steps from a queue in order; the
scheduler waits for a result on its Future (a condition variable: no spinning). The scheduler
never reads what the thread writes before that Future is done: the thread gets a
ModelWorkerBatch and hands back a SampleOutput, and the token buffer is the thread's own.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Protocol

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.model_worker.future_map import FutureMap

_Step = tuple[ModelWorkerBatch, torch.Tensor, "Future[SampleOutput]"]


class ModelWorker(Protocol):
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        """The next token of every sequence of the batch (and logprobs when asked for)."""
        ...


class OverlapWorker:
    def __init__(self, worker: ModelWorker, future_map: FutureMap):
        self.worker = worker
        self.future_map = future_map
        self._steps: queue.SimpleQueue[_Step] = queue.SimpleQueue()
        # CUDA's current device is per thread: this thread takes the one the scheduler's thread
        # set (build_model_runner), or its forwards and collectives would run on cuda:0.
        self.cuda_device = _current_cuda_device()
        # A daemon: the process ends by SIGTERM or with its parent, never by joining this.
        self._thread = threading.Thread(target=self._run, name="overlap-worker", daemon=True)
        self._thread.start()

    def launch(self, batch: ModelWorkerBatch, future_slots: torch.Tensor) -> Future[SampleOutput]:
        """Queue one step; its sampled tokens go to `future_slots` of the FutureMap, for the
        placeholders of the steps after it."""
        result: Future[SampleOutput] = Future()
        self._steps.put((batch, future_slots, result))
        return result

    def _run(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        while True:
            batch, slots, result = self._steps.get()
            try:
                output = self.worker.forward(self.future_map.resolve(batch))
                self.future_map.store(slots, output.last_token_ids)
            except BaseException as error:  # the scheduler thread re-raises it from result()
                result.set_exception(error)
            else:
                result.set_result(output)


def _current_cuda_device() -> torch.device | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.device("cuda", torch.cuda.current_device())
