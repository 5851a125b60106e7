"""Host-side bookkeeping of device cache memory: KV blocks (pages) and recurrent-state slots.

Index 0 of each pool is never handed out: padding rows of a batch write there. Never touches device arrays.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class OutOfMemory(RuntimeError):
    """No free block or slot is left; the scheduler preempts or waits."""


class BlockPool:
    """Free list of KV-cache blocks 1..num_blocks-1 with reference counts (shared prefix blocks have > 1)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks in the order they should be reused (least recently freed first). An OrderedDict so that a free
        # block still holding a cached prefix can be taken back out in O(1) when a new request hits it.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int = 1) -> list[int]:
        if count > len(self.free):
            raise OutOfMemory(f"asked for {count} KV blocks, {len(self.free)} free")
        blocks = [self.free.popitem(last=False)[0] for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def retain(self, block: int) -> None:
        """Add a reference (a prefix-cache hit); a free block is taken off the free list."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} released more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
                self.free[b] = None
        return freed


class SlotPool:
    """Free list of recurrent-state slots 1..num_slots-1 (one per running sequence of a hybrid model)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"need at least 2 state slots (one is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(1, num_slots))
        self.in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfMemory("no free recurrent-state slot")
        slot = self.free.popleft()
        self.in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self.in_use:
            raise RuntimeError(f"state slot {slot} released but not in use")
        self.in_use.remove(slot)
        self.free.append(slot)
