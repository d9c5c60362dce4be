"""The requests in flight, as the tokenizer manager knows them.

A client's rid is only a label: it is unique among that client's own requests in flight, and its
replies carry it. The scheduler and the detokenizer know each completion by an internal id given
here and never reused, so a rid used again (by the same client after a finish, or by another
client at the same time) can never reach someone else's completion.

Two lifetimes, one owner each:
- a completion lives until the scheduler ends it (its final output, or its refusal): the
  scheduler owns "finished";
- a client request lives until its client has had its last reply (every completion's final, or
  one error); then its rid is free again, even while aborted siblings are still winding down.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from radixserve.protocol.internal import Logprob, ReqStrOut
from radixserve.protocol.wire import MetaInfo, OutputReply

Envelope = list[bytes]


@dataclass(slots=True, eq=False)
class InFlightRequest:
    """One `generate` of one client: n completions answering under the client's rid."""

    envelope: Envelope  # the ROUTER envelope its replies go to; envelope[0] names the client
    rid: str
    stream: bool
    ids: list[str]  # internal ids of its completions
    open: int  # completions whose final the client has not had yet
    created: float = field(default_factory=time.monotonic)
    answered: bool = False  # it had its last reply: whatever comes later for it is dropped
    aborted: bool = False  # its client asked to abort it (maybe while it was in the tokenizer)
    counted: bool = True  # in /metrics and --log-requests (SGLang's log_metrics)

    @property
    def peer(self) -> bytes:
        return self.envelope[0]


@dataclass(slots=True, eq=False)
class Completion:
    """One completion at the scheduler. Not streaming, it gathers its pieces until finished."""

    request: InFlightRequest
    index: int | None  # which of the n completions; None when n == 1
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[Logprob] = field(default_factory=list)
    top_logprobs: list[list[Logprob]] = field(default_factory=list)
    last_tokens_at: float | None = None  # when its previous output with tokens came (metrics)

    def reply(self, out: ReqStrOut) -> OutputReply | None:
        """The client's reply to this output: every piece when streaming, else the whole
        completion once it is finished (None until then)."""
        finished = out.finished_reason is not None
        if self.request.stream:
            text, ids = out.text, out.new_token_ids
            token_logprobs, top_logprobs = out.output_token_logprobs, out.output_top_logprobs
        else:
            self.text.append(out.text)
            self.output_ids += out.new_token_ids
            self.token_logprobs += out.output_token_logprobs or []
            self.top_logprobs += out.output_top_logprobs or []
            if not finished:
                return None
            text, ids = "".join(self.text), self.output_ids
            token_logprobs = self.token_logprobs if out.output_token_logprobs is not None else None
            top_logprobs = self.top_logprobs if out.output_top_logprobs is not None else None
        meta = MetaInfo(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            finish_reason=out.finished_reason,
            e2e_latency=time.monotonic() - self.request.created,
            output_token_logprobs=token_logprobs,
            output_top_logprobs=top_logprobs,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
            id=self.request.rid,
        )
        return OutputReply(self.request.rid, text, ids, finished, meta, index=self.index)


class InFlight:
    def __init__(self) -> None:
        self.completions: dict[str, Completion] = {}  # by internal id, until the scheduler's end
        self.by_peer: dict[bytes, dict[str, InFlightRequest]] = {}  # client -> rid -> request
        self._next_id = itertools.count()

    def find(self, peer: bytes, rid: str) -> InFlightRequest | None:
        return self.by_peer.get(peer, {}).get(rid)

    def of_peer(self, peer: bytes) -> list[InFlightRequest]:
        return list(self.by_peer.get(peer, {}).values())

    def open(
        self,
        envelope: Envelope,
        rid: str,
        stream: bool,
        n: int,
        counted: bool = True,
        created: float | None = None,
    ) -> InFlightRequest | None:
        """A new client request with n fresh ids; None if the client has `rid` in flight.
        `created`: when it arrived, if not now."""
        requests = self.by_peer.setdefault(envelope[0], {})
        if rid in requests:
            return None
        ids = [f"{next(self._next_id):x}" for _ in range(n)]
        now = time.monotonic() if created is None else created
        request = InFlightRequest(envelope, rid, stream, ids, open=n, created=now, counted=counted)
        requests[rid] = request
        return request

    def start(self, request: InFlightRequest) -> list[tuple[str, int | None]]:
        """Register the request's completions, about to go to the scheduler: (id, index)."""
        n = len(request.ids)
        started = [(cid, i if n > 1 else None) for i, cid in enumerate(request.ids)]
        for cid, index in started:
            self.completions[cid] = Completion(request, index)
        return started

    def live_ids(self, request: InFlightRequest) -> list[str]:
        """Its completions the scheduler has not ended yet."""
        return [cid for cid in request.ids if cid in self.completions]

    def end(self, cid: str) -> Completion | None:
        """The scheduler ended completion `cid` (finished, aborted, or refused)."""
        return self.completions.pop(cid, None)

    def answer(self, request: InFlightRequest) -> None:
        """The client had its last reply for `request`: its rid may be used again."""
        request.answered = True
        requests = self.by_peer.get(request.peer)
        if requests is not None and requests.get(request.rid) is request:
            del requests[request.rid]
            if not requests:
                del self.by_peer[request.peer]
