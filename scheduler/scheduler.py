"""The scheduler: waiting queue, running requests, one mixed prefill+decode batch per step.

Each step: every running request advances (a decode by 1 token, a chunked prefill by its next
chunk); if their KV does not fit, requests are retracted to the waiting queue; otherwise waiting
requests are admitted by PrefillAdder. One forward runs the whole batch. No sockets here:
scheduler/process.py feeds requests in and ships outputs out.

The data path, one way: TokenizedGenerateReq -> Req -> ScheduleBatch -> ModelWorkerBatch ->
(model worker: ForwardBatch -> logits -> SampleOutput) -> Req.output_ids -> ReqTokenOut.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.protocol.internal import ReqError, ReqTokenOut, TokenizedGenerateReq
from radixserve.protocol.wire import FinishReason, ServerInfoReply
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_manager import KVManager, require
from radixserve.scheduler.output import next_output, record_logprobs
from radixserve.scheduler.prefill_adder import (
    NewTokenRatio,
    Planned,
    PrefillAdder,
    reserved_tokens,
    sort_by_prefix_match,
)
from radixserve.scheduler.req import Req, make_req
from radixserve.scheduler.sampling_rows import SamplingRows
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger("radixserve.scheduler")

# After a retraction, assume each running request still needs this many decode steps (SGLang).
RETRACT_DECODE_STEPS = 20


class ModelWorker(Protocol):
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        """The next token of every sequence of the batch (and logprobs when asked for)."""
        ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, worker: ModelWorker):
        self.config = config
        self.worker = worker
        self.kv = KVManager(
            config.max_total_tokens,
            config.max_running_requests,
            config.context_len,
            config.enable_radix_cache,
            config.page_size,
        )
        self.sampling_rows = SamplingRows(config.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = NewTokenRatio()
        self.stats = SchedulerStats()
        self.outbox: list[ReqTokenOut] = []  # outputs for the detokenizer, drained by the loop

    # ---- input ---------------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReq) -> ReqError | None:
        req = make_req(msg, self.config)
        if isinstance(req, ReqError):
            return req
        self.stats.prompt_tokens += len(req.origin_input_ids)
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = FinishReason("length")
            self.outbox.append(next_output(req))
        else:
            self.waiting.append(req)
        return None

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        """End a waiting or running request now (abort, or a stop string the detokenizer found);
        unknown rids (already finished) are ignored."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.kv.release(req)
                    req.finished_reason = reason or FinishReason("abort")
                    self.outbox.append(next_output(req))
                    return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> ScheduleBatch | None:
        start = time.perf_counter()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.process_batch_result(batch, self.run_batch(batch))
        self.stats.busy_time_since_log += time.perf_counter() - start
        if self.config.check_invariants:
            self.check_invariants(batch)
        return batch

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        plan, num_decodes, retracted, prefill_budget = self._plan_running()
        if self.waiting and not retracted:
            plan += self._admit_waiting(prefill_budget)
        if not plan:
            return None
        reqs, extend_lens, emits = (list(column) for column in zip(*plan))
        return ScheduleBatch.prepare(reqs, extend_lens, emits, num_decodes, self.kv)

    def run_batch(self, batch: ScheduleBatch) -> SampleOutput:
        return self.worker.forward(batch.to_model_worker_batch(self.kv, self.sampling_rows))

    def process_batch_result(self, batch: ScheduleBatch, result: SampleOutput) -> None:
        next_token_ids = result.next_token_ids.tolist()
        if result.token_logprobs is not None:
            record_logprobs(batch, result)
        stats = self.stats
        stats.count_step(batch)
        context_len = self.config.context_len
        for req, prefix, extend, emits, token in zip(
            batch.reqs, batch.prefix_lens, batch.extend_lens, batch.emits, next_token_ids
        ):
            req.num_computed_tokens = prefix + extend
            if not emits:
                self.kv.cache_unfinished(req)  # a prefill chunk: later requests may share it
                continue  # its sampled token predicts nothing yet
            req.output_ids.append(token)
            if req.seen is not None:
                req.seen = req.seen.with_output(token)
            stats.gen_tokens_since_log += 1
            req.check_finished(token, context_len)
            if req.finished_reason is not None:
                self.running.remove(req)
                self.kv.release(req)
                self.outbox.append(next_output(req))
                continue
            if extend > 1:
                self.kv.cache_unfinished(req)  # a fresh prompt: concurrent requests may share it
            if req.streams_steps:
                self.outbox.append(next_output(req))
        if batch.num_decodes:
            stats.num_decode_steps += 1
            self.new_token_ratio.decay()
            if stats.num_decode_steps % self.config.log_interval == 0:
                stats.log_decode(self.kv, len(self.running), len(self.waiting))
        if batch.num_decodes < len(batch.reqs):
            stats.log_prefill(batch, self.kv, len(self.running), len(self.waiting))

    # ---- planning the running requests --------------------------------------------------------

    def _plan_running(self) -> tuple[list[Planned], int, bool, int]:
        """Tokens each running request computes this step: decodes 1 each, then prefill chunks
        in the budget left. Retracts requests until the plan's KV fits. Returns the plan, how
        many of it are decodes, whether anything was retracted, and how many prompt tokens the
        step may still take for waiting requests."""
        retracted = False
        while True:
            plan: list[Planned] = []
            prefilling: list[tuple[Req, int]] = []
            num_decodes = 0
            for req in self.running:
                n = req.num_uncomputed_tokens
                if n == 1:
                    plan.append((req, 1, True))
                    num_decodes += bool(req.output_ids)
                else:
                    prefilling.append((req, n))
            budget = self.config.max_prefill_tokens - len(plan)
            chunk = self.config.chunked_prefill_size  # prompt tokens of the whole step
            for req, uncomputed in prefilling:
                n = min(uncomputed, chunk, budget)
                if n > 0:
                    plan.append((req, n, n == uncomputed))
                    budget -= n
                    chunk -= n
            if self.config.max_prefill_tokens - budget <= self.kv.available:
                return plan, num_decodes, retracted, min(budget, chunk)
            self._retract_one()
            retracted = True

    def _retract_one(self) -> None:
        """retract_decode, one victim: the request with the fewest outputs (then the longest
        prompt) goes back to the front of the waiting queue and will be recomputed."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_computed_tokens = 0
        victim.retracted = True
        self.waiting.appendleft(victim)
        self.stats.num_retractions += 1
        if self.running:
            decoded = sum(len(r.output_ids) for r in self.running)
            wanted = sum(r.sampling_params.max_new_tokens for r in self.running)
            estimate = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max(wanted, 1)
            self.new_token_ratio.raise_to(estimate)
        logger.info(
            "Retract request %s. #running-req: %d, new_token_ratio: %.2f",
            victim.rid,
            len(self.running),
            self.new_token_ratio.value,
        )

    def _admit_waiting(self, prefill_budget: int) -> list[Planned]:
        ratio = self.new_token_ratio.value
        adder = PrefillAdder(
            token_budget=prefill_budget,
            free_kv=self.kv.available - sum(reserved_tokens(r, ratio) for r in self.running),
            running_slots=self.config.max_running_requests - len(self.running),
            ratio=ratio,
        )
        if not adder.can_add:  # then matching prefixes, for lpm or to admit, is wasted work
            return []
        if self.config.schedule_policy == "lpm":
            self.waiting = sort_by_prefix_match(self.waiting, self.kv)
        admitted = adder.admit(self.waiting, self.kv)
        for req, _, _ in admitted:
            assert req.kv is not None
            self.sampling_rows.write(req.kv.row, req)
            self.running.append(req)
            if not req.retracted:  # a recompute finds its own KV cached: no hit
                req.cached_tokens = min(req.kv.cached_len, len(req.origin_input_ids))
                self.stats.cached_tokens += req.cached_tokens
        return admitted

    # ---- queries and bookkeeping -----------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when nothing runs, since running requests lock it."""
        if self.has_unfinished():
            return False
        self.kv.flush()
        return True

    def server_info(self) -> ServerInfoReply:
        return self.stats.server_info(
            self.kv, len(self.running), len(self.waiting), self.config.max_running_requests
        )

    def check_invariants(self, batch: ScheduleBatch | None) -> None:
        """What every step must keep (--check-invariants; the tests turn it on). O(KV pool)."""
        cfg = self.config
        waiting, running = {id(r) for r in self.waiting}, {id(r) for r in self.running}
        require(len(waiting) == len(self.waiting), "a request is twice in the waiting queue")
        require(len(running) == len(self.running), "a request is twice in the running batch")
        require(not waiting & running, "a request is both waiting and running")
        require(len(running) <= cfg.max_running_requests, "more running requests than the cap")
        for req in self.waiting:
            require(not req.finished, f"finished request {req.rid} still waiting")
            require(
                req.kv is None and req.num_computed_tokens == 0,
                f"waiting request {req.rid} holds KV",
            )
        for req in self.running:
            require(not req.finished, f"finished request {req.rid} still running")
        if batch is not None:
            require(batch.num_tokens <= cfg.max_prefill_tokens, "the step went over its budget")
            require(all(n > 0 for n in batch.extend_lens), "a request computes nothing")
            require(
                sum(n for n in batch.extend_lens if n > 1) <= cfg.chunked_prefill_size,
                "the step's prompt tokens went over --chunked-prefill-size",
            )
        self.kv.check(self.running)
