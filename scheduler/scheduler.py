"""The scheduler: waiting queue, running requests, one mixed prefill+decode batch per step.

Each step: every running request advances (a decode by 1 token, a chunked prefill by its next
chunk); if their KV does not fit, requests are retracted to the waiting queue; otherwise waiting
requests are admitted by PrefillAdder. One forward runs the whole batch. No sockets here:
scheduler/process.py feeds requests in and ships outputs out.

Overlap scheduling (SGLang's event_loop_overlap): a step is launched on the OverlapWorker's
thread, and its result is processed one step later, after the next step is planned and launched;
so the scheduler's Python runs while the model computes. A launched step counts as done for
planning: its tokens are placeholders (Req.future_ids) until its result comes back. A request
that finishes by a stop token has then already been given one more step, whose token is dropped
(its KV is valid, and is cached or freed with the rest). Without overlap the result is processed
at once, through the same code. A step after one with constrained requests does not overlap it:
their next vocab mask needs the tokens just sampled (scheduler/grammar.py), so the step in flight
is processed first (SGLang instead delays filling the mask on its worker thread).

The data path, one way: TokenizedGenerateReq -> Req -> ScheduleBatch -> ModelWorkerBatch ->
(model worker: ForwardBatch -> logits -> SampleOutput) -> Req.output_ids -> ReqTokenOut.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

import msgspec

from radixserve.model_worker.batch import SampleOutput
from radixserve.model_worker.future_map import FutureMap
from radixserve.model_worker.overlap_worker import ModelWorker, OverlapWorker
from radixserve.protocol.internal import ReqError, ReqTokenOut, TokenizedGenerateReq
from radixserve.protocol.wire import FinishReason, ServerInfoReply
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.grammar import (
    GrammarBackend,
    GrammarQueue,
    accept_token,
    has_grammar,
    vocab_mask,
)
from radixserve.scheduler.kv_manager import KVManager, require
from radixserve.scheduler.output import LogprobRows, next_output, record_prompt_logprobs
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
from radixserve.scheduler.speculation import Drafter
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger("radixserve.scheduler")

# After a retraction, assume each running request still needs this many decode steps (SGLang).
RETRACT_DECODE_STEPS = 20


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, worker: ModelWorker, grammars: GrammarBackend | None = None
    ):
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
        self.future_map = FutureMap(config.max_running_requests)
        self.overlap = OverlapWorker(worker, self.future_map) if config.enable_overlap else None
        self.drafter = Drafter(config.speculative) if config.speculative else None
        # The step launched but not processed yet (overlap only).
        self.in_flight: tuple[ScheduleBatch, Future[SampleOutput]] | None = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = NewTokenRatio()
        self.stats = SchedulerStats()
        self.outbox: list[ReqTokenOut] = []  # outputs for the detokenizer, drained by the loop
        # Requests whose grammar compiles (None: no grammar backend, constrained ones refused).
        self.grammar_queue = GrammarQueue(grammars) if grammars is not None else None
        self.errors: list[ReqError] = []  # refusals found after add_request, drained by the loop

    # ---- input ---------------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReq) -> ReqError | None:
        self.stats.num_requests += 1  # received, refused or not (the DP controller's count)
        queued = len(self.waiting) + self.grammars_compiling
        if queued >= self.config.max_queued_requests:
            message = f"{queued} requests wait (--max-queued-requests)"
            return ReqError(msg.rid, "overloaded", message)
        req = make_req(msg, self.config)
        if isinstance(req, ReqError):
            return req
        self.stats.prompt_tokens += len(req.origin_input_ids)
        grammar = req.sampling_params.grammar
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = FinishReason("length")
            self.outbox.append(next_output(req))
        elif grammar is None:
            self.waiting.append(req)
        elif self.grammar_queue is None:
            return ReqError(req.rid, "invalid_request", f"{grammar[0]}: no grammar backend here")
        else:
            self.grammar_queue.add(req, *grammar)
        return None

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        """End a waiting or running request now (abort, or a stop string the detokenizer found);
        unknown rids (already finished) are ignored."""
        compiling = self.grammar_queue.remove(rid) if self.grammar_queue is not None else None
        if compiling is not None:
            compiling.finished_reason = reason or FinishReason("abort")
            self.outbox.append(next_output(compiling))
            return
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.kv.release(req)
                    req.finished_reason = reason or FinishReason("abort")
                    self.outbox.append(next_output(req))
                    return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or self.grammars_compiling)

    @property
    def grammars_compiling(self) -> int:
        return len(self.grammar_queue) if self.grammar_queue is not None else 0

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> ScheduleBatch | None:
        """Plan and launch a step; process the result of the previous one (overlap) or of this
        one. Returns the step launched, else the one processed: None when there was nothing."""
        start = time.perf_counter()
        if self.grammars_compiling:
            self._admit_compiled()
        synced = None
        in_flight = self.in_flight
        if in_flight is not None and (has_grammar(in_flight[0].reqs) or self._may_speculate()):
            # The next step's vocab mask needs this one's tokens, and drafts continue a request's
            # real tokens (the next step must know how many were accepted): no overlap with it.
            synced, self.in_flight = in_flight, None
            self.process_batch_result(synced[0], synced[1].result())
        batch = self.get_next_batch_to_run()
        launched = (batch, self.run_batch(batch)) if batch is not None else None
        if self.overlap is not None and not (batch is not None and batch.draft_lens):
            done, self.in_flight = self.in_flight, launched
        else:
            done = launched
        if done is not None:
            self.process_batch_result(done[0], done[1].result())
        self.stats.busy_time_since_log += time.perf_counter() - start
        if self.config.check_invariants:
            self.check_invariants(batch)
        processed = done or synced
        return batch or (processed[0] if processed else None)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue; failed ones are refused."""
        assert self.grammar_queue is not None
        ready, errors = self.grammar_queue.take_ready()
        self.waiting.extend(ready)
        self.errors += errors

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        plan, num_decodes, retracted, prefill_budget = self._plan_running()
        drafts = self._draft(plan) if self._may_speculate() else None
        if drafts:
            num_drafts = sum(map(len, drafts))
            step_left = self.config.max_prefill_tokens - sum(n for _, n, _ in plan)
            prefill_budget = min(prefill_budget, step_left)
        else:
            num_drafts = 0
        if self.waiting and not retracted:
            plan += self._admit_waiting(prefill_budget, num_drafts)
        if not plan:
            # Idle: the next burst starts from the first estimate, not from the last one's
            # decay or retractions (SGLang resets it so whenever it has no batch).
            self.new_token_ratio = NewTokenRatio()
            return None
        if drafts:
            drafts += [[] for _ in range(len(plan) - len(drafts))]
        reqs, extend_lens, emits = (list(column) for column in zip(*plan))
        future_slots = self.future_map.alloc(len(reqs))
        return ScheduleBatch.prepare(
            reqs, extend_lens, emits, num_decodes, self.kv, future_slots, drafts or None
        )

    def run_batch(self, batch: ScheduleBatch) -> Future[SampleOutput]:
        """Launch the step: from here on its requests count it as done, their emitted tokens
        placeholders until its result is processed. Prompt tokens go into the prefix cache now,
        so that the next step (planned while this one runs) can share them: their KV is written
        before any later step reads it."""
        worker_batch = batch.to_model_worker_batch(self.kv, self.sampling_rows)
        if self.grammar_queue is not None:  # read from the matchers now: no token is in flight
            vocab = self.grammar_queue.backend.vocab_size
            worker_batch.sampling.vocab_mask = vocab_mask(batch.reqs, batch.emits, vocab)
        placeholders = (-batch.future_slots).tolist()
        draft_lens = batch.draft_lens or [0] * len(batch.reqs)
        for req, prefix, extend, emits, placeholder, num_drafts in zip(
            batch.reqs, batch.prefix_lens, batch.extend_lens, batch.emits, placeholders, draft_lens
        ):
            req.num_computed_tokens = prefix + extend  # drafts included, until verified
            if emits:
                req.future_ids.append(placeholder)
            if (extend > 1 or not emits) and not num_drafts:  # a prefill chunk or a whole prompt
                self.kv.cache_unfinished(req)
        if self.overlap is not None:
            return self.overlap.launch(worker_batch, batch.future_slots)
        result: Future[SampleOutput] = Future()
        result.set_result(self.worker.forward(worker_batch))
        return result

    def process_batch_result(self, batch: ScheduleBatch, result: SampleOutput) -> None:
        """Each request's new tokens: one, or a speculating request's accepted run, cut at a stop
        token or its length; its rejected drafts' KV is freed at once."""
        tokens = result.next_token_ids.tolist()
        run_lens = result.accept_lens.tolist() if result.accept_lens is not None else None
        logprobs = LogprobRows(result) if result.token_logprobs is not None else None
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(batch, result)
        draft_lens = batch.draft_lens
        stats = self.stats
        stats.count_step(batch)
        context_len = self.config.context_len
        end = 0
        for i, (req, emits) in enumerate(zip(batch.reqs, batch.emits)):
            start, end = end, end + (run_lens[i] if run_lens else 1)
            if req.finished:  # aborted, or ended by the step before (overlap): drop its token
                continue
            if not emits:
                continue  # a prefill chunk: its sampled token predicts nothing yet
            if req.prompt_only:  # it ran for its prompt's logprobs: its sample is no output
                req.future_ids.clear()
                req.finished_reason = FinishReason("length")
                self._remove(req)
                self.kv.release(req)
                self.outbox.append(next_output(req))
                continue
            for at in range(start, end):
                token = tokens[at]
                if at == start:
                    req.resolve_output(token)
                else:  # a speculating request has nothing else in flight
                    req.output_ids.append(token)
                if logprobs is not None and req.return_logprob:
                    logprobs.record(req, at)
                if req.seen is not None:
                    req.seen = req.seen.with_output(token)
                stats.gen_tokens_since_log += 1
                if req.grammar is not None:
                    accept_token(req, token)  # a complete grammar ends it (stop)
                if req.finished_reason is None:
                    req.check_finished(token, context_len)
                if req.finished_reason is not None:
                    break
            if draft_lens and draft_lens[i]:
                assert self.drafter is not None
                self.drafter.record(req, draft_lens[i], end - start - 1)
                self.kv.drop_tail(req, req.num_tokens - 1)  # the accepted tokens' KV stays
            if req.finished_reason is not None:
                self._remove(req)
                self.kv.release(req)
                self.outbox.append(next_output(req))
                continue
            if req.streams_steps:
                self.outbox.append(next_output(req))
        if batch.num_decodes:
            stats.num_decode_steps += 1
            self.new_token_ratio.decay()
            if stats.num_decode_steps % self.config.log_interval == 0:
                accept_length = self.drafter.stats.close_interval() if self.drafter else None
                stats.log_decode(self.kv, len(self.running), len(self.waiting), accept_length)
        if batch.num_decodes < len(batch.reqs):
            stats.log_prefill(batch, self.kv, len(self.running), len(self.waiting))

    def _remove(self, req: Req) -> None:
        """A request that ended leaves the running batch, or the waiting queue: it may have been
        retracted while its last token was in flight (overlap)."""
        if req.kv is not None:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

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
                if req.reached_length(self.config.context_len):
                    continue  # its last token is in flight (overlap): it ends when that is back
                n = req.num_uncomputed_tokens
                if n == 1:
                    plan.append((req, 1, True))
                    num_decodes += req.num_outputs > 0
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
        victim = min(self.running, key=lambda r: (r.num_outputs, -len(r.origin_input_ids)))
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_computed_tokens = 0
        victim.retracted = True
        self.waiting.appendleft(victim)
        self.stats.num_retractions += 1
        if self.running:
            decoded = sum(r.num_outputs for r in self.running)
            wanted = sum(r.sampling_params.max_new_tokens for r in self.running)
            estimate = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max(wanted, 1)
            self.new_token_ratio.raise_to(estimate)
        logger.info(
            "Retract request %s. #running-req: %d, new_token_ratio: %.2f",
            victim.rid,
            len(self.running),
            self.new_token_ratio.value,
        )

    # ---- speculation -------------------------------------------------------------------------

    def _may_speculate(self) -> bool:
        return self.drafter is not None and self.drafter.step_speculates(len(self.running))

    def _draft(self, plan: list[Planned]) -> list[list[int]] | None:
        """Drafts for the plan's decodes, which then compute them too (plan entries grow), in
        the step's token budget and the KV left after the plan: speculation never retracts.
        Each decode's drafts, in plan order; None when there are none."""
        if self.in_flight is not None:  # its requests' last tokens are not known yet
            return None
        assert self.drafter is not None
        planned = sum(n for _, n, _ in plan)
        spare = min(self.config.max_prefill_tokens, self.kv.available) - planned
        drafts: list[list[int]] = []
        for i, (req, n, emits) in enumerate(plan):
            draft: list[int] = []
            if n == 1 and emits and spare > 0:
                # The run (drafts + 1 token) stays within max_new_tokens, and the drafts' KV
                # positions within the context.
                limit = min(
                    spare,
                    req.remaining_new_tokens - 1,
                    self.config.context_len - req.num_tokens,
                )
                draft = self.drafter.propose(req, limit)
                if draft:
                    plan[i] = (req, 1 + len(draft), True)
                    spare -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _admit_waiting(self, prefill_budget: int, num_drafts: int = 0) -> list[Planned]:
        """Waiting requests for this step; `num_drafts`: KV slots the step's drafts take."""
        ratio = self.new_token_ratio.value
        adder = PrefillAdder(
            token_budget=prefill_budget,
            free_kv=self.kv.available
            - num_drafts
            - sum(reserved_tokens(r, ratio) for r in self.running),
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
        info = self.stats.server_info(
            self.kv, len(self.running), len(self.waiting), self.config.max_running_requests
        )
        if self.drafter is None:
            return info
        spec = self.drafter.stats
        return msgspec.structs.replace(
            info,
            spec_verifies=spec.verifies,
            spec_draft_tokens=spec.drafts,
            spec_accepted_tokens=spec.accepted,
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
            drafts = batch.draft_lens or [0] * len(batch.reqs)
            require(
                sum(n for n, d in zip(batch.extend_lens, drafts) if n > 1 and not d)
                <= cfg.chunked_prefill_size,
                "the step's prompt tokens went over --chunked-prefill-size",
            )
        self.kv.check(self.running)
