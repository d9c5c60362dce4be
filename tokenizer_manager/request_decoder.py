"""Client frames to typed requests: authorized first, then validated.

A request that fails either gets a ClientError naming what is wrong, with the request's rid
whenever it can be read (WIRE.md). Without the key a client learns nothing else: a malformed
request is "unauthorized" too.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec

from radixserve.protocol.wire import (
    MAX_API_KEY_CHARS,
    MAX_RID_CHARS,
    ClientRequest,
    HealthRequest,
)

MAX_ERROR_CHARS = 512


class ClientError(Exception):
    """A request refused: the client gets an `error` reply with this code."""

    def __init__(self, code: str, message: str, rid: str | None = None):
        # msgspec's messages quote the offending key or value: never echo or log it whole.
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "... (cut)"
        super().__init__(message)
        self.code, self.message, self.rid = code, message, rid


class _Label(msgspec.Struct):
    """What is read of a request that fails validation: its rid, for the error, and its key."""

    rid: Any = None
    api_key: Any = None


class RequestDecoder:
    def __init__(self, api_key: str | None):
        self.api_key = api_key.encode() if api_key else None
        self._decoder = msgspec.msgpack.Decoder(ClientRequest)
        self._label_decoder = msgspec.msgpack.Decoder(_Label)

    def decode(self, payload: bytes) -> Any:
        """The typed request, or a ClientError (unauthorized, or invalid_request)."""
        try:
            req = self._decoder.decode(payload)
        # ValueError: a str that is not UTF-8 (UnicodeDecodeError), which msgspec lets through.
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError) as e:
            rid, api_key = self._label_of(payload)
            self.authorize(api_key, rid)
            message = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ClientError("invalid_request", message, rid) from None
        if not isinstance(req, HealthRequest):  # liveness probes carry no secret (as SGLang)
            self.authorize(req.api_key, getattr(req, "rid", None))
        return req

    def unreadable(self, payload: bytes) -> ClientError:
        """The error for a request the server failed to read (a bug): unauthorized for a
        client without the key, who learns nothing more; else internal, with its rid."""
        rid, api_key = self._label_of(payload)
        try:
            self.authorize(api_key, rid)
        except ClientError as e:
            return e
        return ClientError(
            "internal", "the server failed to read this request (a bug: see its log)", rid
        )

    def authorize(self, api_key: str | None, rid: str | None) -> None:
        if self.api_key is None:
            return
        # compare_digest takes as long for any wrong key: timing tells nothing of the right one.
        if api_key is None or not hmac.compare_digest(api_key.encode(), self.api_key):
            raise ClientError("unauthorized", "missing or wrong api_key", rid)

    def _label_of(self, payload: bytes) -> tuple[str | None, str | None]:
        """The rid and api_key of a request that failed validation; None for what cannot be
        read (a deep nesting raises RecursionError in the decoder: nothing is read then)."""
        try:
            label = self._label_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError):
            return None, None
        rid, key = label.rid, label.api_key
        rid = rid if isinstance(rid, str) and len(rid) <= MAX_RID_CHARS else None
        key = key if isinstance(key, str) and len(key) <= MAX_API_KEY_CHARS else None
        return rid, key
