"""Issue 13's regression tests that speak only the command line and the wire, so that
tests/replay_issue13.py can run them on the code from before the fixes too (each of them red
there, green here). One tiny server serves those that do not take it down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from regression_wire import CONTEXT, POOL, Wire, server_flags

from radixserve.client.local_server import LaunchedServer, launched_server


@pytest.fixture(scope="session")
def small_server(tiny_served_model: Path) -> Iterator[LaunchedServer]:
    flags = server_flags(
        "--context-length", str(CONTEXT), "--max-total-tokens", str(POOL), "--check-invariants"
    )
    with launched_server("--model", str(tiny_served_model), *flags) as server:
        yield server


@pytest.fixture
def wire(small_server: LaunchedServer) -> Iterator[Wire]:
    w = Wire(small_server)
    yield w
    w.close()
