"""The flat ragged batch every layer runs on: all of a step's new tokens on one token axis (decode rows are one-token
queries, prefill chunks several), with per-token positions and per-request offsets, state slots and block tables.

Plain data (a NamedTuple of arrays) and a numpy builder; no layer math, no devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Ragged(NamedTuple):
    """What the layers know of a step's batch. T tokens (a padded bucket) of R requests (a padded bucket).

    Tokens of request r are [query_start[r], query_start[r] + query_len[r]) on the token axis, at positions
    context_len[r] - query_len[r], ... , context_len[r] - 1 of its sequence. Requests may come in any order and need
    not be contiguous; padding tokens (token_valid False) belong to no request, padding requests have query_len 0,
    state slot 0 and block 0 everywhere (the sinks: nothing real lives there)."""

    positions: np.ndarray  # [T] int32; 0 on padding tokens
    token_request: np.ndarray  # [T] int32 request index of each token; 0 on padding tokens
    token_valid: np.ndarray  # [T] bool
    query_start: np.ndarray  # [R] int32
    query_len: np.ndarray  # [R] int32; 0 for padding requests
    context_len: np.ndarray  # [R] int32: tokens in the sequence once this step's are in
    state_slot: np.ndarray  # [R] int32 recurrent-state slot (hybrid models; 0 elsewhere)
    fresh: np.ndarray  # [R] bool: the request starts its sequence here (a zero recurrent state, not its slot's)
    block_table: np.ndarray  # [R, W] int32 KV pages


def ragged(starts: Sequence[int], lens: Sequence[int], slots: Sequence[int], tables: Sequence[Sequence[int]],
           num_tokens: int, num_requests: int, table_width: int, query_start: Sequence[int] | None = None,
           request_index: Sequence[int] | None = None) -> Ragged:
    """The Ragged of requests where request i runs `lens[i]` new tokens from position `starts[i]` of its sequence,
    on state slot `slots[i]` and KV pages `tables[i]`. Its tokens start at `query_start[i]` on the token axis and it is
    request `request_index[i]` of the batch (default: one after another from token 0, requests 0, 1, ...; the
    tokens and requests between are padding). Padded to `num_tokens` tokens and `num_requests` requests (numpy, for
    the host side of a step)."""
    count = len(lens)
    lens_a = np.asarray(lens, np.int32)
    offsets = np.cumsum(lens_a) - lens_a if query_start is None else np.asarray(query_start, np.int32)
    index = np.arange(count) if request_index is None else np.asarray(request_index, np.int64)
    if count > num_requests or not len(starts) == len(slots) == len(tables) == len(offsets) == len(index) == count \
            or (count and (offsets + lens_a).max() > num_tokens):
        raise ValueError(f"{count} requests of {int(lens_a.sum())} tokens for a batch of {num_requests} requests and "
                         f"{num_tokens} tokens")
    query_start_a, query_len, start_pos, state_slot = (np.zeros(num_requests, np.int32) for _ in range(4))
    query_start_a[index], query_len[index], start_pos[index], state_slot[index] = offsets, lens_a, starts, slots
    block_table = np.zeros((num_requests, table_width), np.int32)
    for r, table in zip(index, tables, strict=True):
        block_table[r, :len(table)] = table
    request = np.repeat(np.arange(count), lens_a)  # each new token's request, in the order of `lens`
    within = np.arange(len(request), dtype=np.int32) - np.repeat(np.cumsum(lens_a) - lens_a, lens_a)
    at = np.repeat(offsets, lens_a) + within  # each new token's place on the token axis
    positions, token_request = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    token_valid = np.zeros(num_tokens, bool)
    positions[at] = np.asarray(starts, np.int32)[request] + within
    token_request[at], token_valid[at] = index[request], True
    return Ragged(positions=positions, token_request=token_request, token_valid=token_valid,
                  query_start=query_start_a, query_len=query_len, context_len=start_pos + query_len,
                  state_slot=state_slot, fresh=(start_pos == 0) & (query_len > 0), block_table=block_table)
