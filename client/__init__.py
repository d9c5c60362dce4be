"""A Python client for radixserve's ZMQ wire format (WIRE.md), blocking and asyncio."""

from radixserve.client.async_client import AsyncClient
from radixserve.client.messages import DEFAULT_ADDRESS, ProtocolError, ServerError
from radixserve.client.sync_client import Client

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "Client", "ProtocolError", "ServerError"]
