"""The model's own sampling defaults (`--sampling-defaults model`, SGLang's flag; vLLM's
`--generation-config auto`): a request that leaves out temperature, top_p, top_k, min_p or
repetition_penalty gets the value in the model's generation_config.json, where there is one.

Only a field the request did not send takes a default, even when it sent SGLang's own default
value: a decoded SamplingParams cannot tell (a missing field decodes to its default), so the
payload's sampling_params keys are read once more, their values skipped unread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from radixserve.protocol.wire import GenerateRequest, SamplingParams

logger = logging.getLogger("radixserve.tokenizer_manager")

MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _SentSamplingParams(msgspec.Struct):
    sampling_params: dict[str, msgspec.Raw] | None = None


_sent_decoder = msgspec.msgpack.Decoder(_SentSamplingParams)
_sent_json_decoder = msgspec.json.Decoder(_SentSamplingParams)


def load_sampling_defaults(model_path: str, mode: str) -> dict[str, Any]:
    """The fields generation_config.json sets ({} for `openai`), checked as a request's are."""
    path = Path(model_path) / "generation_config.json"
    if mode == "openai" or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    given = {name: config[name] for name in MODEL_DEFAULT_FIELDS if config.get(name) is not None}
    if given.get("top_k") == 0:
        given["top_k"] = -1  # transformers' "off"
    try:
        checked = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e} (or start with --sampling-defaults openai)") from None
    defaults = {name: getattr(checked, name) for name in given}
    if defaults:
        logger.info("Sampling defaults from %s: %s", path, defaults)
    return defaults


def apply_sampling_defaults(
    req: msgspec.Struct, payload: bytes, defaults: dict[str, Any]
) -> msgspec.Struct:
    """`req`, decoded from msgpack `payload`, with the defaults of the fields it did not send."""
    if not defaults or not isinstance(req, GenerateRequest):
        return req
    sent = _sent_decoder.decode(payload).sampling_params or {}
    return fill_sampling_defaults(req, sent, defaults)


def sent_sampling_fields_json(body: bytes) -> Collection[str]:
    """The sampling_params keys of a JSON `generate` body (HTTP), their values skipped unread;
    a null is no value sent (the field's default, as SGLang's clients mean it)."""
    params = _sent_json_decoder.decode(body).sampling_params or {}
    return [name for name, value in params.items() if bytes(value) != b"null"]


def fill_sampling_defaults(
    req: GenerateRequest, sent: Collection[str], defaults: dict[str, Any]
) -> GenerateRequest:
    """`req` with the defaults of the sampling fields that are not in `sent`."""
    missing = {name: value for name, value in defaults.items() if name not in sent}
    if not missing:
        return req
    params = msgspec.structs.replace(req.sampling_params, **missing)
    return msgspec.structs.replace(req, sampling_params=params)
