"""The memory plan of one replica: how many sequences, KV blocks and prefix-cache state snapshots its caches hold,
from byte counts of its tightest device, or which limit a configuration passes and the largest value that fits.

Pure arithmetic over plain numbers: it never touches a device, so it runs (and refuses) before anything compiles.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

GiB = 2**30
# max_num_seqs when it is not given: the most that fit, at most this many. The warm-up compiles programs for every
# count of rows up to max_num_seqs (samplers, snapshot copies, penalty resets), so a higher cap costs every start.
MAX_NUM_SEQS_CAP = 64
# Prefix-cache snapshots of recurrent state take at most this share of the memory the sequences' states leave.
SNAPSHOT_SHARE = 0.2


def engine_share(stats: dict, utilization: float) -> float:
    """The bytes of a device this engine may take at gpu_memory_utilization `utilization` (vLLM's meaning: a share of
    the whole device), from its memory statistics: XLA's allocator may grow to XLA_PYTHON_CLIENT_MEM_FRACTION of the
    device (its `bytes_limit`), and never past it."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return min(stats["bytes_limit"] * utilization / fraction, float(stats["bytes_limit"]))


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes on one device of a replica, at one tensor-parallel size."""

    weights: float  # the weights, placed or not (and whatever else the device already holds)
    per_slot: int  # one sequence's recurrent state, every GDN layer (0: no GDN layer)
    per_counts: int  # one sequence's rows of the sampling tables (penalty counts, logit bias, bans, grammar mask),
    # whole on every device
    per_block: int  # one KV block of every attention layer


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    max_num_seqs: int
    num_blocks: int  # KV blocks, the padding sink (block 0) included
    num_snapshots: int  # prefix-cache state snapshots
    spare: float  # bytes of the capacity left beside the weights, the working memory held free and the caches


class MemoryPlanError(ValueError):
    """A configuration that does not fit. `limit` names what binds ("weights", "max_num_seqs" or "max_model_len");
    `fits` is the largest value of it that fits (weights: the smallest tensor-parallel size; None: none found)."""

    def __init__(self, message: str, limit: str, fits: int | None):
        super().__init__(message)
        self.limit = limit
        self.fits = fits


def plan_memory(capacity: float, footprint: Footprint, *, block_size: int, max_model_len: int,
                max_num_seqs: int | None, keeps_snapshots: bool, num_snapshots: int | None = None,
                num_kv_blocks: int | None = None, working: float = 0.0,
                wider: Callable[[], Sequence[tuple[int, Footprint]]] = tuple) -> MemoryPlan:
    """The caches of one replica in `capacity` bytes (what this engine may take of its tightest device), beside the
    weights and `working` bytes held free for the programs' working memory (the largest program's, measured).

    Every sequence holds a slot (recurrent state and penalty counts; slot 0 is the padding sink), then come the
    prefix-cache snapshots (`keeps_snapshots`: a hybrid model with prefix caching; by default at most 2 a sequence
    and SNAPSHOT_SHARE of what the slots leave), then the KV blocks: room for every sequence at max_model_len twice
    over (for the prefix cache), or what fits. `num_kv_blocks` (usable blocks) replaces the memory-derived count.

    max_num_seqs None: the most sequences, at most MAX_NUM_SEQS_CAP, whose slots fit with KV blocks for each of them
    at max_model_len tokens (at least 1). A given max_num_seqs is kept as it is, or refused.

    Checks run in the order of what binds, and a refusal (MemoryPlanError) names the limit and the value that fits:
    the weights must leave room for one sequence (one slot and one KV block beside the sinks); then the slots of
    max_num_seqs sequences must fit with one KV block; then one sequence of max_model_len must find its KV blocks.
    `wider()`: (tensor-parallel size, Footprint there) to try, smallest first (asked only on a refusal); a refusal
    names the first under which the same configuration fits."""
    room = capacity - footprint.weights - working  # for the caches
    per_seq = footprint.per_slot + footprint.per_counts
    needs = -(-max_model_len // block_size)  # KV blocks of one sequence at max_model_len

    def snapshots(seqs: int) -> int:
        if not keeps_snapshots:
            return 0
        if num_snapshots is not None:
            return int(num_snapshots)
        free = max(room - (seqs + 1) * per_seq, 0)
        return int(min(2 * seqs + 1, SNAPSHOT_SHARE * free // max(footprint.per_slot, 1)))

    def kv_room(seqs: int) -> float:
        """Bytes left for KV blocks beside `seqs` sequences' slots and their snapshots."""
        return room - (seqs + 1) * per_seq - snapshots(seqs) * footprint.per_slot

    def usable_blocks(seqs: int) -> int:
        """KV blocks (the sink not counted) beside `seqs` sequences' slots: -1 when the slots themselves do not fit
        (with one block beside them when the blocks come from memory, with the given blocks when given)."""
        if num_kv_blocks is not None:  # given: they (and the sink) must fit too
            return int(num_kv_blocks) if kv_room(seqs) >= (num_kv_blocks + 1) * footprint.per_block else -1
        if not footprint.per_block:
            return 2 * seqs * needs if kv_room(seqs) >= 0 else -1
        blocks = int(kv_room(seqs) // footprint.per_block) - 1
        return blocks if blocks >= 1 else -1

    def most_seqs(upto: int, each: bool = False) -> int:
        """The most sequences, up to `upto`, whose slots fit with the KV blocks of one sequence at max_model_len
        (`each`: of every one of them); 0: none."""
        return next((n for n in range(upto, 0, -1) if usable_blocks(n) >= (n if each else 1) * needs), 0)

    def smallest_tp() -> int | None:
        """The smallest of the `wider` tensor-parallel sizes at which this configuration fits (None: none)."""
        for size, there in wider():
            try:
                plan_memory(capacity, there, block_size=block_size, max_model_len=max_model_len,
                            max_num_seqs=max_num_seqs, keeps_snapshots=keeps_snapshots,
                            num_snapshots=num_snapshots, num_kv_blocks=num_kv_blocks, working=working)
            except MemoryPlanError:
                continue
            return size
        return None

    def or_tp() -> str:
        tp = smallest_tp()
        return f", or -tp {tp}" if tp else ""

    if usable_blocks(1) < 0:
        tp = smallest_tp()
        one = 2 * per_seq + 2 * footprint.per_block  # a sequence's slot and KV block, and the padding sinks
        raise MemoryPlanError(
            f"the weights take {footprint.weights / GiB:.2f} GiB a device, the programs' working memory "
            f"{working / GiB:.2f} GiB and the cache of one sequence at least {one / GiB:.2f} GiB more; this engine may "
            f"take {capacity / GiB:.2f} GiB of this device at this --gpu-memory-utilization: use "
            + (f"-tp {tp}" if tp else "more devices (-tp)"), "weights", tp)
    seqs = (most_seqs(MAX_NUM_SEQS_CAP, each=True) or 1) if max_num_seqs is None else int(max_num_seqs)
    if usable_blocks(seqs) < 0:
        fits = most_seqs(seqs - 1)
        if fits:
            raise MemoryPlanError(
                f"recurrent state for {seqs} sequences needs {(seqs + 1) * per_seq / GiB:.2f} GiB ({seqs + 1} slots "
                f"of {per_seq / 2**20:.1f} MiB), {room / GiB:.2f} GiB are free beside the weights and the programs' "
                f"working memory: at most {fits} sequences fit at max_model_len {max_model_len} on this device; use "
                f"--max-num-seqs {fits}{or_tp()}",
                "max_num_seqs", fits)
        seqs = 1  # not even one sequence of max_model_len fits: max_model_len binds, whatever the sequences
    blocks = usable_blocks(seqs)
    if blocks < needs:
        longest = blocks * block_size
        fewer = most_seqs(seqs - 1)
        held = (f"num_kv_blocks is {blocks}" if num_kv_blocks is not None else
                f"{blocks} fit beside the recurrent state of {seqs} sequence{'s' if seqs > 1 else ''}")
        raise MemoryPlanError(
            f"one sequence of max_model_len {max_model_len} needs {needs} KV blocks of {block_size} tokens "
            f"({needs * footprint.per_block / GiB:.2f} GiB); {held}: the longest max_model_len that fits is "
            f"{longest}; use --max-model-len {longest}"
            + (f" --max-num-seqs {seqs}" if max_num_seqs is not None and seqs != max_num_seqs else "")
            + (f", or --max-num-seqs {fewer} to keep max_model_len {max_model_len}" if fewer else "") + or_tp(),
            "max_model_len", longest)
    num_blocks = 1 + (blocks if num_kv_blocks is not None else min(2 * seqs * needs, blocks))
    caches = (seqs + 1) * per_seq + snapshots(seqs) * footprint.per_slot + num_blocks * footprint.per_block
    return MemoryPlan(seqs, num_blocks, snapshots(seqs), max(room - caches, 0.0))
