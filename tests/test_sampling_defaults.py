"""The model's sampling defaults (--sampling-defaults model): read from generation_config.json,
given only to the fields a request's bytes leave out. End to end: tests/test_commands.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from radixserve.model_worker import model_source
from radixserve.protocol.wire import ClientRequest, GenerateRequest
from radixserve.tokenizer_manager.sampling_defaults import (
    apply_sampling_defaults,
    load_sampling_defaults,
    sent_sampling_fields_json,
)

QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2}


def model_dir(tmp_path: Path, generation_config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(tmp_path)


def decoded(request: dict) -> tuple[msgspec.Struct, bytes]:
    payload = msgspec.msgpack.encode(request)
    return msgspec.msgpack.decode(payload, type=ClientRequest), payload


def test_loads_the_sampling_fields_and_nothing_else(tmp_path):
    defaults = load_sampling_defaults(model_dir(tmp_path, QWEN3_LIKE), "model")
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert load_sampling_defaults(str(tmp_path), "openai") == {}
    assert load_sampling_defaults(str(tmp_path / "missing"), "model") == {}


def test_transformers_top_k_0_means_off_and_bad_values_name_the_file(tmp_path):
    assert load_sampling_defaults(model_dir(tmp_path, {"top_k": 0}), "model") == {"top_k": -1}
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        load_sampling_defaults(model_dir(tmp_path, {"top_p": 1.5}), "model")


def test_only_fields_the_request_did_not_send_take_a_default():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    # temperature 1.0 is SGLang's own default: sent, it must stay.
    sent = {"temperature": 1.0, "max_new_tokens": 8}
    req, payload = decoded({"type": "generate", "text": "hi", "sampling_params": sent})
    params = apply_sampling_defaults(req, payload, defaults).sampling_params
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (
        1.0,
        20,
        0.95,
        8,
    )
    req, payload = decoded({"type": "generate", "input_ids": [1, 2]})
    params = apply_sampling_defaults(req, payload, defaults).sampling_params
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 0.95)
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # not in the model's file


def test_requests_without_sampling_are_left_alone():
    req, payload = decoded({"type": "health"})
    assert apply_sampling_defaults(req, payload, {"temperature": 0.6}) is req
    every = {"temperature": 0.5, "top_p": 0.5}
    req, payload = decoded({"type": "generate", "text": "x", "sampling_params": every})
    assert apply_sampling_defaults(req, payload, {"temperature": 0.6, "top_p": 0.9}) is req
    assert isinstance(req, GenerateRequest)


def test_the_converted_default_model_carries_its_model_card_recommendation(tmp_path):
    assert load_sampling_defaults(str(model_source.default_model_dir()), "model") == {
        "temperature": 0.2,
        "top_p": 0.9,
    }
    # An older conversion gains the fields it lacks; a value someone wrote there stays.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.5}))
    model_source._recommend_sampling(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.5}


def test_a_null_in_a_json_body_is_no_value_sent():
    """SGLang's clients send unset fields as null: those take the model's default, as fields
    left out do; so does a null sampling_params."""
    body = b'{"text": "x", "sampling_params": {"temperature": null, "top_p": 0.5}}'
    assert list(sent_sampling_fields_json(body)) == ["top_p"]
    assert list(sent_sampling_fields_json(b'{"text": "x", "sampling_params": null}')) == []
    assert list(sent_sampling_fields_json(b'{"text": "x"}')) == []
