"""What the scheduler counts, and how it reports it: SGLang's log lines and server_info."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.protocol.wire import ServerInfoReply
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.scheduler")


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_mixed_steps: int = 0
    num_retractions: int = 0
    num_prefill_tokens: int = 0  # tokens computed for prompts (and recomputes), not decodes
    num_decode_steps: int = 0
    prompt_tokens: int = 0
    num_requests: int = 0
    cached_tokens: int = 0  # each request's cached_tokens, counted once
    gen_tokens_since_log: int = 0
    busy_time_since_log: float = 0.0  # seconds spent in steps: idle time is not throughput
    gen_throughput: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def count_step(self, batch: ScheduleBatch) -> None:
        self.num_steps += 1
        self.num_mixed_steps += batch.is_mixed
        self.num_prefill_tokens += batch.num_tokens - batch.num_decodes - batch.num_draft_tokens

    def log_prefill(
        self, batch: ScheduleBatch, kv: KVManager, num_running: int, num_waiting: int
    ) -> None:
        logger.info(
            "Prefill batch. #prefill-seq: %d, #new-token: %d, cache hit rate: %.1f%%, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(batch.reqs) - batch.num_decodes,
            batch.num_tokens - batch.num_decodes - batch.num_draft_tokens,
            100 * self.cache_hit_rate,
            kv.used / kv.max_total_tokens,
            num_running,
            num_waiting,
        )

    def log_decode(
        self, kv: KVManager, num_running: int, num_waiting: int, accept_length: float | None
    ) -> None:
        """The decode log line, with the throughput since the previous one, and with speculation
        its accept length (SGLang's: tokens per verifying request step)."""
        self.gen_throughput = self.gen_tokens_since_log / max(self.busy_time_since_log, 1e-9)
        self.gen_tokens_since_log, self.busy_time_since_log = 0, 0.0
        spec = "" if accept_length is None else f"accept len: {accept_length:.2f}, "
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
            "gen throughput (token/s): %.2f, #queue-req: %d",
            num_running,
            kv.used,
            kv.used / kv.max_total_tokens,
            spec,
            self.gen_throughput,
            num_waiting,
        )

    def server_info(
        self, kv: KVManager, num_running: int, num_waiting: int, max_running_requests: int
    ) -> ServerInfoReply:
        return ServerInfoReply(
            running_requests=num_running,
            waiting_requests=num_waiting,
            kv_tokens_used=kv.used,
            kv_tokens_total=kv.max_total_tokens,
            cache_hit_rate=self.cache_hit_rate,
            gen_throughput=self.gen_throughput if num_running else 0.0,  # idle: 0, as SGLang's
            num_steps=self.num_steps,
            num_mixed_steps=self.num_mixed_steps,
            num_retractions=self.num_retractions,
            num_evicted_tokens=kv.num_evicted_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            max_running_requests=max_running_requests,
            prompt_tokens=self.prompt_tokens,
            num_requests=self.num_requests,
        )
