"""The scheduler: waiting queue, running requests, one mixed prefill+decode batch per step.

Each step: every running request advances (a decode by 1 token, a chunked prefill by its next
chunk); if their KV does not fit, requests are retracted to the waiting queue; otherwise waiting
requests are admitted by PrefillAdder. One forward runs the whole batch. No sockets here:
scheduler/process.py feeds requests in and ships outputs out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import msgspec

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.protocol.internal import ReqError, ReqTokenOut, TokenizedGenerateReq
from radixserve.protocol.wire import FinishReason, ServerInfoReply
from radixserve.scheduler.invariants import check_invariants
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.prefill_adder import NewTokenRatio, PrefillAdder, reserved_tokens
from radixserve.scheduler.radix_cache import common_prefix_len
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_rows import SamplingRows
from radixserve.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.scheduler")

# One request's share of a step: (request, tokens it computes, whether it then emits a token).
Planned = tuple[Req, int, bool]

# After a retraction, assume each running request still needs this many decode steps (SGLang).
RETRACT_DECODE_STEPS = 20
# Past this many waiting requests, lpm's prefix matching costs more than it saves (SGLang).
LPM_MAX_QUEUE = 128
# A waiting request that shares this many uncached tokens (or all of them) with one admitted in
# the same step waits a step: then it finds them in the tree instead of computing them again.
IN_BATCH_SHARED_PREFIX = 32


class ModelWorker(Protocol):
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        """The next token of every sequence of the batch (and logprobs when asked for)."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_total_tokens: int  # usable KV slots
    max_running_requests: int
    max_prefill_tokens: int  # token budget of one step
    # Prompt tokens computed in one step, over all its requests (SGLang's chunked_prefill_size):
    # a longer prompt, or a longer queue of them, is prefilled over several steps.
    chunked_prefill_size: int
    context_len: int
    eos_token_ids: frozenset[int]
    log_interval: int = 40
    check_invariants: bool = False
    enable_radix_cache: bool = True
    page_size: int = 1
    schedule_policy: str = "fcfs"  # or "lpm": longest prefix match first


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_mixed_steps: int = 0
    num_retractions: int = 0
    num_prefill_tokens: int = 0  # tokens computed for prompts (and recomputes), not decodes
    num_decode_steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gen_tokens_since_log: int = 0
    busy_time_since_log: float = 0.0  # seconds spent in steps: idle time is not throughput
    gen_throughput: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / max(self.prompt_tokens, 1)


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
        params = msg.sampling_params
        n_prompt = len(msg.input_ids)
        if n_prompt >= self.config.context_len:
            return ReqError(
                msg.rid,
                "too_long",
                f"the prompt has {n_prompt} tokens; the context length is "
                f"{self.config.context_len}, which must leave room for at least one new token",
            )
        # Clipped to the context, as SGLang and vLLM do: admission reserves KV for max_new_tokens,
        # so an unclipped one could be accepted here and never admitted, blocking the queue.
        max_new = min(params.max_new_tokens, self.config.context_len - n_prompt)
        if max_new != params.max_new_tokens:
            params = msgspec.structs.replace(params, max_new_tokens=max_new)
        peak = n_prompt + max_new
        if peak > self.config.max_total_tokens:
            return ReqError(
                msg.rid,
                "too_long",
                f"prompt + max_new_tokens needs {peak} KV tokens; the whole KV pool holds "
                f"{self.config.max_total_tokens} (--max-total-tokens)",
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.config.eos_token_ids
        req = Req(
            msg.rid,
            msg.input_ids,
            params,
            msg.stream,
            frozenset(stop_ids),
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
        )
        self.stats.prompt_tokens += n_prompt
        if params.max_new_tokens == 0:
            req.finished_reason = FinishReason("length")
            self._emit(req)
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
                    self._emit(req)
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
            check_invariants(self, batch)
        return batch

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        plan, num_decodes, retracted, prefill_budget = self._plan_running()
        if self.waiting and not retracted:
            plan += self._admit_waiting(prefill_budget)
        if not plan:
            return None
        reqs, extend_lens, emits = (list(column) for column in zip(*plan))
        out_cache_loc = self.kv.alloc(sum(extend_lens))
        assert out_cache_loc is not None, "planning left too few free KV slots"
        return ScheduleBatch(
            reqs=reqs,
            prefix_lens=[r.num_computed_tokens for r in reqs],
            extend_lens=extend_lens,
            emits=emits,
            out_cache_loc=out_cache_loc,
            num_decodes=num_decodes,
        )

    def run_batch(self, batch: ScheduleBatch) -> SampleOutput:
        mwb = batch.to_model_worker_batch(self.kv.req_to_token_pool, self.sampling_rows)
        return self.worker.forward(mwb)

    def process_batch_result(self, batch: ScheduleBatch, result: SampleOutput) -> None:
        next_token_ids = result.next_token_ids.tolist()
        if result.token_logprobs is not None:
            self._record_logprobs(batch, result)
        stats = self.stats
        stats.num_steps += 1
        stats.num_mixed_steps += batch.is_mixed
        stats.num_prefill_tokens += batch.num_tokens - batch.num_decodes
        context_len = self.config.context_len
        for req, prefix, extend, emits, token in zip(
            batch.reqs, batch.prefix_lens, batch.extend_lens, batch.emits, next_token_ids
        ):
            req.num_computed_tokens = prefix + extend
            if not emits:
                self.kv.cache_unfinished(req)  # a prefill chunk: later requests may share it
                continue  # its sampled token predicts nothing yet
            req.output_ids.append(token)
            stats.gen_tokens_since_log += 1
            req.check_finished(token, context_len)
            if req.finished_reason is not None:
                self.running.remove(req)
                self.kv.release(req)
                self._emit(req)
                continue
            if extend > 1:
                self.kv.cache_unfinished(req)  # a fresh prompt: concurrent requests may share it
            if req.streams_steps:
                self._emit(req)
        if batch.num_decodes:
            stats.num_decode_steps += 1
            self.new_token_ratio.decay()
            if stats.num_decode_steps % self.config.log_interval == 0:
                self._log_decode()
        if batch.num_decodes < len(batch.reqs):
            self._log_prefill(batch)

    def _record_logprobs(self, batch: ScheduleBatch, result: SampleOutput) -> None:
        """Keep the logprobs of each real output token, for requests that asked for them."""
        token_logprobs = result.token_logprobs.tolist()
        top_values = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
        tokens = result.next_token_ids.tolist()
        for i, (req, emits) in enumerate(zip(batch.reqs, batch.emits)):
            if not req.return_logprob or not emits:
                continue
            req.output_token_logprobs.append((token_logprobs[i], tokens[i]))
            if req.top_logprobs_num:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(top_values[i][:k], top_ids[i][:k])))

    # ---- planning ------------------------------------------------------------------------------

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
        if self.config.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            self._sort_waiting_by_prefix_match()
        ratio = self.new_token_ratio.value
        reserve = sum(reserved_tokens(r, ratio) for r in self.running)
        adder = PrefillAdder(
            token_budget=prefill_budget,
            free_kv=self.kv.available - reserve,
            running_slots=self.config.max_running_requests - len(self.running),
            ratio=ratio,
        )
        admitted: list[Planned] = []
        while self.waiting:
            req = self.waiting[0]
            available = self.kv.available
            prefix_slots = self.kv.attach_prefix(req)
            if self._shares_uncached_prefix(req, admitted):
                self.kv.detach_prefix(req)
                break
            # The matched prefix is locked now: it no longer counts as evictable.
            adder.free_kv -= available - self.kv.available
            n = adder.try_add(req)
            if n == 0:
                self.kv.detach_prefix(req)
                break
            self.waiting.popleft()
            self.kv.assign_row(req, prefix_slots)
            self.sampling_rows.write(req.req_pool_idx, req)
            self.running.append(req)
            admitted.append((req, n, n == req.num_uncomputed_tokens))
            cached_prompt = min(req.prefix_len, len(req.origin_input_ids))
            req.cached_tokens = max(req.cached_tokens, cached_prompt)
            self.stats.cached_tokens += cached_prompt
        return admitted

    def _shares_uncached_prefix(self, req: Req, admitted: list[Planned]) -> bool:
        if self.kv.tree_cache is None or not admitted:
            return False
        # Worth a step of waiting: a long shared span, or all it would compute but the one token
        # it always computes (n > 1 completions of one prompt, say).
        threshold = min(IN_BATCH_SHARED_PREFIX, req.num_uncomputed_tokens - 1)
        if threshold <= 0:
            return False
        tokens = req.token_slice(0, req.num_tokens)
        return any(
            common_prefix_len(tokens, other.token_slice(0, other.num_tokens), 1)
            >= req.prefix_len + threshold
            for other, _, _ in admitted
        )

    def _sort_waiting_by_prefix_match(self) -> None:
        tree = self.kv.tree_cache
        if tree is None:
            return
        matched = {
            id(r): len(tree.match_prefix(r.token_slice(0, r.num_tokens)).slots)
            for r in self.waiting
        }
        self.waiting = deque(sorted(self.waiting, key=lambda r: -matched[id(r)]))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when nothing runs, since running requests lock it."""
        if self.has_unfinished():
            return False
        self.kv.flush()
        return True

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _emit(self, req: Req) -> None:
        # Positional arguments: this runs for every streaming request on every step.
        sent = req.num_sent_tokens
        outputs = req.output_ids
        req.num_sent_tokens = len(outputs)
        params = req.sampling_params
        logprobs = req.output_token_logprobs[sent:] if req.return_logprob else None
        top_logprobs = req.output_top_logprobs[sent:] if req.top_logprobs_num else None
        self.outbox.append(
            ReqTokenOut(
                req.rid,
                outputs[sent:],
                req.finished_reason,
                len(req.origin_input_ids),
                len(outputs),
                req.cached_tokens,
                params.skip_special_tokens,
                params.stop,
                logprobs,
                top_logprobs,
            )
        )

    def server_info(self) -> ServerInfoReply:
        stats = self.stats
        return ServerInfoReply(
            running_requests=len(self.running),
            waiting_requests=len(self.waiting),
            kv_tokens_used=self.kv.used,
            kv_tokens_total=self.config.max_total_tokens,
            cache_hit_rate=stats.cache_hit_rate,
            gen_throughput=stats.gen_throughput,
            num_steps=stats.num_steps,
            num_mixed_steps=stats.num_mixed_steps,
            num_retractions=stats.num_retractions,
            num_evicted_tokens=self.kv.num_evicted_tokens,
            num_prefill_tokens=stats.num_prefill_tokens,
            max_running_requests=self.config.max_running_requests,
        )

    def _log_prefill(self, batch: ScheduleBatch) -> None:
        logger.info(
            "Prefill batch. #prefill-seq: %d, #new-token: %d, cache hit rate: %.1f%%, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(batch.reqs) - batch.num_decodes,
            batch.num_tokens - batch.num_decodes,
            100 * self.stats.cache_hit_rate,
            self.kv.used / self.config.max_total_tokens,
            len(self.running),
            len(self.waiting),
        )

    def _log_decode(self) -> None:
        stats = self.stats
        stats.gen_throughput = stats.gen_tokens_since_log / max(stats.busy_time_since_log, 1e-9)
        stats.gen_tokens_since_log, stats.busy_time_since_log = 0, 0.0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(self.running),
            self.kv.used,
            self.kv.used / self.config.max_total_tokens,
            stats.gen_throughput,
            len(self.waiting),
        )
