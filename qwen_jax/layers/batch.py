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
           num_tokens: int, num_requests: int, table_width: int) -> Ragged:
    """The Ragged of requests laid out one after another from token 0: request i runs `lens[i]` new tokens from
    position `starts[i]` of its sequence, on state slot `slots[i]` and KV pages `tables[i]`. Padded to `num_tokens`
    tokens and `num_requests` requests (numpy, for the host side of a step)."""
    count = len(lens)
    total = int(sum(lens))
    if count > num_requests or total > num_tokens or not len(starts) == len(slots) == len(tables) == count:
        raise ValueError(f"{count} requests of {total} tokens for a batch of {num_requests} requests and "
                         f"{num_tokens} tokens")
    lens_a = np.asarray(lens, np.int32)
    query_start = np.zeros(num_requests, np.int32)
    query_start[:count] = np.cumsum(lens_a) - lens_a
    query_len = np.zeros(num_requests, np.int32)
    query_len[:count] = lens_a
    start_pos = np.zeros(num_requests, np.int32)
    start_pos[:count] = starts
    token_request = np.zeros(num_tokens, np.int32)
    token_request[:total] = np.repeat(np.arange(count, dtype=np.int32), lens_a)
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = start_pos[token_request[:total]] + np.arange(total, dtype=np.int32) \
        - query_start[token_request[:total]]
    block_table = np.zeros((num_requests, table_width), np.int32)
    for i, table in enumerate(tables):
        block_table[i, :len(table)] = table
    state_slot = np.zeros(num_requests, np.int32)
    state_slot[:count] = slots
    return Ragged(positions=positions, token_request=token_request, token_valid=np.arange(num_tokens) < total,
                  query_start=query_start, query_len=query_len, context_len=start_pos + query_len,
                  state_slot=state_slot, fresh=(start_pos == 0) & (query_len > 0), block_table=block_table)
