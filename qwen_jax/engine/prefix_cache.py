"""Exact prefix caching for attention and hybrid models: full prompt blocks are hashed as a chain; attention layers
reuse the KV blocks, recurrent layers restore a snapshot of their state taken at a block boundary.

Host-side index only (block ids and snapshot indices); the runner moves the device data. A hit must never change
logits: snapshots are taken at boundaries that the prefill computes in the same chunks whether or not it hits.
"""

from __future__ import annotations

from collections import OrderedDict

from qwen_jax.engine.memory import BlockPool


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hash chain over the full blocks: h_i = hash((h_{i-1}, tokens of block i))."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


def snapshot_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The one block boundary of a prompt where a hybrid model's recurrent state is snapshotted: the last one that
    still leaves at least one prompt token to compute (that token's logits start generation)."""
    return (num_prompt_tokens - 1) // block_size * block_size


class PrefixCache:
    def __init__(self, blocks: BlockPool, num_snapshots: int, hybrid: bool):
        self.blocks = blocks
        self.hybrid = hybrid
        self.block_of: dict[int, int] = {}  # chain hash -> KV block holding those tokens
        self.hash_of: dict[int, int] = {}  # KV block -> its chain hash
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # chain hash -> snapshot index, in LRU order
        self.free_snapshots = list(range(num_snapshots, 0, -1))  # index 0 is the runner's write sink
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens served from the cache

    # ---- lookup at admission -------------------------------------------------------------------------------
    def match(self, hashes: list[int], num_prompt_tokens: int) -> tuple[list[int], int | None]:
        """Longest usable cached prefix: (its KV blocks, snapshot index or None). Takes no references."""
        bs = self.blocks.block_size
        limit = min(len(hashes), (num_prompt_tokens - 1) // bs)  # always compute at least one token
        found: list[int] = []
        for h in hashes[:limit]:
            block = self.block_of.get(h)
            if block is None:
                break
            found.append(block)
        if not self.hybrid:
            return found, None
        # A hybrid model also needs the recurrent state at the end of the matched prefix.
        for n in range(len(found), 0, -1):
            snap = self.snapshot_of.get(hashes[n - 1])
            if snap is not None:
                self.snapshot_of.move_to_end(hashes[n - 1])
                return found[:n], snap
        return [], None

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    # ---- registration as prefill progresses ----------------------------------------------------------------
    def register_blocks(self, hashes: list[int], block_table: list[int], num_computed: int) -> None:
        """Index the prompt blocks that are now completely in the cache."""
        full = min(len(hashes), num_computed // self.blocks.block_size)
        for i in range(full):
            h, block = hashes[i], block_table[i]
            if h not in self.block_of and block not in self.hash_of:
                self.block_of[h] = block
                self.hash_of[block] = h

    def forget_block(self, block: int) -> None:
        """A free block is being reused for new tokens: its cached content is gone."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]

    def claim_snapshot(self, chain_hash: int) -> int | None:
        """A snapshot index to save the state at this boundary into (evicting the least recently used),
        or None when this boundary already has one or there is no snapshot memory."""
        if chain_hash in self.snapshot_of:
            return None
        if not self.free_snapshots:
            if not self.snapshot_of:
                return None
            _, index = self.snapshot_of.popitem(last=False)
            self.free_snapshots.append(index)
        index = self.free_snapshots.pop()
        self.snapshot_of[chain_hash] = index
        return index
