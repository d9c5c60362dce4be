"""KVHandle: a running request's hold on KV memory, as KVManager hands it out.

    its ReqToTokenPool row:  [ cached_len slots: the prefix cache's | the request's own ....... ]
                                                                      up to num_computed_tokens ^

Contract: only KVManager makes handles, and each KVManager call that changes a hold returns a new
one (the old one is void). While a request holds a handle, its first `cached_len` slots belong to
the prefix cache and are locked there: eviction cannot take them, and the request must not free
them. Everything else only reads `row` and `cached_len`. A waiting request holds none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVHandle:
    row: int  # its row of ReqToTokenPool (and of SamplingRows)
    cached_len: int  # leading tokens whose KV slots the prefix cache owns, whole pages
