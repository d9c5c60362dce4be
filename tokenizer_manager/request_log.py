"""--log-requests: one line per completion that ended, and per request that failed.

Client-controlled strings (the rid) are written with repr(), so that none can forge a log line.
"""

from __future__ import annotations

import logging
import time

from radixserve.protocol.internal import ReqStrOut
from radixserve.tokenizer_manager.inflight import InFlightRequest

logger = logging.getLogger("radixserve.tokenizer_manager")


def finished(request: InFlightRequest, index: int | None, out: ReqStrOut) -> None:
    reason = out.finished_reason
    assert reason is not None
    matched = "" if reason.matched is None else f" ({reason.matched!r})"
    logger.info(
        "Finish: rid=%r%s, prompt_tokens=%d, completion_tokens=%d, cached_tokens=%d, "
        "e2e_latency=%.3f, finish_reason=%s%s",
        request.rid,
        "" if index is None else f", index={index}",
        out.prompt_tokens,
        out.completion_tokens,
        out.cached_tokens,
        time.monotonic() - request.created,
        reason.type,
        matched,
    )


def failed(rid: str | None, code: str, message: str) -> None:
    logger.info("Fail: rid=%r, code=%s, message=%r", rid, code, message)
