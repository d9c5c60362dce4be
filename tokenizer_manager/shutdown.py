"""SIGTERM's drain: give the requests in flight --shutdown-timeout seconds to finish, abort the
rest, and let every last reply leave before the process exits."""

from __future__ import annotations

import asyncio
import time

from radixserve.tokenizer_manager.inflight import InFlight
from radixserve.tokenizer_manager.replies import Replies
from radixserve.tokenizer_manager.scheduler_link import SchedulerLink

ABORT_WAIT_S = 10.0  # how long the scheduler may take to end aborted requests
FINAL_FLUSH_S = 2.0  # how long the last replies may take to leave


async def drain(
    inflight: InFlight, link: SchedulerLink, replies: Replies, shutdown_timeout: float
) -> None:
    """New generates are refused by now (Admission.accepting)."""
    await _wait_for_no_requests(inflight, link, shutdown_timeout, abort=False)
    await _wait_for_no_requests(inflight, link, ABORT_WAIT_S, abort=True)
    await replies.flush_last(FINAL_FLUSH_S)


async def _wait_for_no_requests(
    inflight: InFlight, link: SchedulerLink, timeout: float, abort: bool
) -> None:
    aborted: set[str] = set()
    deadline = time.monotonic() + timeout
    # by_peer: a request whose prompt is still in the tokenizer has no completion yet.
    while (inflight.completions or inflight.by_peer) and time.monotonic() < deadline:
        if abort:  # those started meanwhile too: a prompt may have been in the tokenizer
            late = inflight.completions.keys() - aborted
            await link.abort(list(late))
            aborted |= late
        await asyncio.sleep(0.02)
