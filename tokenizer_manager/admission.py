"""A generate's way in: admitted under the intake's caps (intake.py), registered at once, then
tokenized and sent to the scheduler in a task of its own, so that while a long prompt is in the
tokenizer the manager goes on taking everyone's requests (aborts, health checks, other
generates)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec

from radixserve.protocol.internal import AbortReq, TokenizedGenerateReq
from radixserve.protocol.wire import INT64_MIN, GenerateRequest, check_output_top_logprobs
from radixserve.tokenizer_manager.inflight import Envelope, InFlight, InFlightRequest
from radixserve.tokenizer_manager.intake import Intake, Ticket, held_bytes
from radixserve.tokenizer_manager.replies import Replies
from radixserve.tokenizer_manager.request_decoder import ClientError
from radixserve.tokenizer_manager.scheduler_link import SchedulerLink
from radixserve.tokenizer_manager.tokenization import PromptTooLong, Tokenization

logger = logging.getLogger("radixserve.tokenizer_manager")

SHUTTING_DOWN = "the server is shutting down"


class Admission:
    def __init__(
        self,
        tokenization: Tokenization,
        inflight: InFlight,
        link: SchedulerLink,
        replies: Replies,
        intake: Intake,
    ):
        self.tokenization = tokenization
        self.inflight = inflight
        self.link = link
        self.replies = replies
        self.intake = intake
        self.accepting = True  # until shutdown
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references

    def admit(self, envelope: Envelope, req: GenerateRequest, arrived: float | None = None) -> None:
        """Register the request now, so that its client's next message (an abort) finds it;
        tokenize and send it in a task. ClientError when it is refused at once."""
        rid = req.rid or uuid.uuid4().hex
        if not self.accepting:
            raise ClientError("overloaded", SHUTTING_DOWN, rid)
        if req.return_logprob:  # the scheduler sees each of the n completions alone
            params = req.sampling_params
            try:
                check_output_top_logprobs(
                    "top_logprobs_num",
                    req.top_logprobs_num,
                    params.max_new_tokens,
                    "max_new_tokens",
                    params.n,
                )
            except ValueError as e:
                raise ClientError("invalid_request", str(e), rid) from None
        ticket = self.intake.take(self.replies.client_of(envelope[0]), held_bytes(req), rid)
        n = req.sampling_params.n
        request = self.inflight.open(
            envelope, rid, req.stream, n, counted=req.log_metrics, created=arrived
        )
        if request is None:
            ticket.release()
            raise ClientError("invalid_request", f"rid {rid!r} is already in flight", rid)
        work = self._send(request, req, ticket)
        task = asyncio.create_task(self.replies.answer_errors(envelope, work, rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: InFlightRequest, req: GenerateRequest, ticket: Ticket) -> None:
        try:
            await self._tokenize_and_send(request, req)
        except ClientError:
            raise
        except Exception as e:
            await self._end_after_bug(request, e)
        finally:
            ticket.release()

    async def _end_after_bug(self, request: InFlightRequest, bug: Exception) -> None:
        """A bug stopped the request on its way: it ends here, its rid free again, and whatever
        of it may have reached the scheduler is aborted (else that ran on unseen and the rid
        stayed taken). Its client gets one `internal` error, unless it had its last reply."""
        logger.error("request %r failed", request.rid, exc_info=bug)
        answered = request.answered
        self.inflight.answer(request)
        live = self.inflight.live_ids(request)
        for cid in live:  # ended here: the scheduler's last words for these (and so their
            self.inflight.end(cid)  # metrics and --log-requests lines) find nothing
        await self.link.abort(live)
        if not answered:
            error = ClientError("internal", f"{type(bug).__name__}: {bug}", request.rid)
            await self.replies.reply_error(request.envelope, error, request)

    async def _tokenize_and_send(self, request: InFlightRequest, req: GenerateRequest) -> None:
        try:
            input_ids = await self.tokenization.input_ids_async(req)
        except Exception as e:
            if request.answered:  # dropped meanwhile (its client gone or too slow): answered
                if not isinstance(e, ValueError):
                    logger.exception("tokenizing request %r failed", request.rid)
                return
            if not isinstance(e, ValueError):
                raise  # a bug: _send ends the request
            self.inflight.answer(request)  # it never reached the scheduler: its rid is free
            code = "too_long" if isinstance(e, PromptTooLong) else "invalid_request"
            raise ClientError(code, str(e), request.rid) from None
        # Nothing awaits from here to the last send: an abort of this request comes before all
        # of it (request.aborted) or after all of it (its completions are live by then).
        sends = []
        base = self.tokenization.with_special_stops(req.sampling_params)
        for cid, index in self.inflight.start(request):
            if request.answered:  # its client went away meanwhile: never started
                self.inflight.end(cid)
                continue
            params = base
            if index is not None:
                # Each completion samples on its own; seeded ones stay reproducible (seed + i).
                seed = None if base.seed is None else _wrap_int64(base.seed + index)
                params = msgspec.structs.replace(base, n=1, seed=seed)
            msg = TokenizedGenerateReq(
                cid,
                input_ids,
                params,
                req.stream,
                req.return_logprob,
                req.top_logprobs_num,
                req.logprob_start_len if req.return_logprob else -1,
            )
            sends.append(self.link.send(msg))
        if request.aborted and not request.answered:
            sends += [self.link.send(AbortReq(cid)) for cid in self.inflight.live_ids(request)]
        await asyncio.gather(*sends)


def _wrap_int64(value: int) -> int:
    """value mod 2**64 as a signed 64-bit integer: completion i of a seeded request draws from
    seed + i, which must stay a valid seed at the top of the range."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN
