"""Scheduler: decides which sequences run in the next step and how many of their tokens (continuous batching,
chunked prefill under a token budget, recompute preemption, prefix-cache admission).

Host-side only: it hands out KV blocks and state slots and returns a plan; it never touches device arrays.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from qwen_jax.engine.memory import BlockPool, SlotPool
from qwen_jax.engine.prefix_cache import PrefixCache, block_hashes, snapshot_boundary
from qwen_jax.engine.sequence import Sequence, Status


@dataclasses.dataclass
class Row:
    """One sequence's share of a step: run tokens [start, start + num_tokens) of seq.token_ids."""

    seq: Sequence
    start: int
    num_tokens: int
    restore_snapshot: int | None = None  # copy this snapshot into the seq's slot before the step
    save_snapshot: int | None = None  # copy the seq's slot into this snapshot after the step

    @property
    def samples(self) -> bool:
        """Whether this row's last token produces the sequence's next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclasses.dataclass
class StepPlan:
    decode: list[Row]  # rows of exactly one token
    prefill: list[Row]  # rows of several tokens
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, blocks: BlockPool, slots: SlotPool | None, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: PrefixCache | None = None):
        self.blocks = blocks
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- queue -----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        needed = self.blocks.blocks_for(seq.num_tokens + seq.params.max_tokens)
        if needed > self.blocks.num_usable:
            raise ValueError(f"request {seq.request_id} needs {needed} KV blocks at its longest, the cache has "
                             f"{self.blocks.num_usable}")
        if self.prefix_cache is not None:
            seq.block_hashes = block_hashes(seq.prompt_token_ids, self.blocks.block_size)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished (or aborted) and free its memory at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- memory ----------------------------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[int]:
        blocks = self.blocks.allocate(count)
        if self.prefix_cache is not None:
            for b in blocks:
                self.prefix_cache.forget_block(b)
        return blocks

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room in seq's block table for num_tokens more computed tokens."""
        need = self.blocks.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        seq.block_table += self._allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the cached state; the sequence re-enters the queue front with its tokens."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        decode: list[Row] = []
        prefill: list[Row] = []
        preempted: list[Sequence] = []
        # Running sequences first, oldest first; preempt the newest when blocks run out.
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            if budget <= 0:
                break
            n = min(seq.num_uncomputed, budget, self._chunk_limit(seq))
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                if victim in queue:
                    queue.remove(victim)
            if seq.status != Status.RUNNING:
                continue
            row = self._row(seq, n)
            (decode if n == 1 else prefill).append(row)
            budget -= n
        # Then admit waiting sequences while there is budget, a free slot and blocks.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self.slots is not None and self.slots.num_free == 0:
                break
            restore = self._admit_prefix(seq)
            n = min(seq.num_uncomputed, budget, self._chunk_limit(seq))
            if not self._grow(seq, n):
                self._free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if self.slots is not None:
                seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            row = self._row(seq, n)
            row.restore_snapshot = restore
            (decode if n == 1 else prefill).append(row)
            budget -= n
        return StepPlan(decode, prefill, preempted)

    def _chunk_limit(self, seq: Sequence) -> int:
        """A prefill chunk ends at the prompt's snapshot boundary (the last full block that leaves a token to compute),
        for every model and whether or not prefix caching is on: a prefix-cache hit resumes exactly there, so runs
        with a hit, with a miss and with caching off all compute the tail in the same chunk and give identical logits.
        Hybrid models with caching on also save their recurrent state at that boundary."""
        boundary = snapshot_boundary(len(seq.prompt_token_ids), self.blocks.block_size)
        if seq.num_computed_tokens < boundary:
            return boundary - seq.num_computed_tokens
        return 1 << 30

    def _admit_prefix(self, seq: Sequence) -> int | None:
        """Attach the cached prefix blocks of a sequence being admitted; returns the snapshot to restore."""
        if self.prefix_cache is None or seq.num_computed_tokens:
            return None
        blocks, snapshot = self.prefix_cache.match(seq.block_hashes, len(seq.prompt_token_ids))
        for b in blocks:
            self.blocks.retain(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.blocks.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_cache.record_lookup(len(seq.prompt_token_ids), seq.num_cached_tokens)
        return snapshot

    def _row(self, seq: Sequence, n: int) -> Row:
        row = Row(seq, seq.num_computed_tokens, n)
        cache = self.prefix_cache
        if cache is not None and cache.hybrid:
            boundary = snapshot_boundary(len(seq.prompt_token_ids), self.blocks.block_size)
            if boundary and row.start + n == boundary and seq.block_hashes:
                row.save_snapshot = cache.claim_snapshot(seq.block_hashes[boundary // self.blocks.block_size - 1])
        return row

    def complete(self, plan: StepPlan) -> None:
        """Advance progress after the step ran; index newly full prompt blocks in the prefix cache."""
        for row in plan.decode + plan.prefill:
            seq = row.seq
            seq.num_computed_tokens += row.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.register_blocks(seq.block_hashes, seq.block_table, seq.num_computed_tokens)
