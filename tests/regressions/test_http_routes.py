"""Issue 22, "/flush_cache changes state on GET and bodies are parsed whatever their content
type": what a web page may send to 127.0.0.1 without the browser asking first (a GET, a
text/plain POST) must change nothing and start nothing."""

from __future__ import annotations

import json

import httpx

from radixserve.client.local_server import LaunchedServer


def test_flush_cache_is_post_only(small_server: LaunchedServer) -> None:
    reply = httpx.get(f"{small_server.http_url}/flush_cache", timeout=30)
    assert reply.status_code == 405, f"GET /flush_cache flushed the cache ({reply.status_code})"


def test_a_body_that_is_not_declared_json_is_refused(small_server: LaunchedServer) -> None:
    body = json.dumps({"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 1}})
    headers = {"Content-Type": "text/plain"}
    reply = httpx.post(f"{small_server.http_url}/generate", content=body, headers=headers)
    assert reply.status_code == 415, f"a text/plain body was parsed ({reply.status_code})"
