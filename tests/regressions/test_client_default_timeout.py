"""Issue 13, "disconnects go unseen": a reply the server lost left the sync client waiting
forever, since its default timeout was None (the server side: test_tokenizer_manager.py)."""

from __future__ import annotations

from radixserve.client import Client
from radixserve.client.local_server import free_port


def test_the_sync_client_never_waits_forever_by_default() -> None:
    with Client(f"tcp://127.0.0.1:{free_port()}") as client:
        assert client.timeout is not None, "the client waits forever for a lost reply"
