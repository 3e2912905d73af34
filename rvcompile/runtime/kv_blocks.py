"""The KV block pool: the one owner of KV-cache block ids (issue 4's paged KV with prefix caching).

Blocks hold `block_size` tokens. A full block may be registered under a chained hash: the hash
of its parent block's hash and its own token ids, so equal prefixes share blocks. A block's
reference count is the number of sequences using it. At zero it joins the free queue but keeps
its hash, and a later sequence with the same prefix can take it back (a prefix-cache hit).
`allocate` takes free blocks from the head of the queue (least recently freed first), evicting
their cached hash, and returns None when too few are free, so the scheduler can preempt. It never
allocates part of a request. Pure Python: no arrays, no device.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT_HASH = b"\x00" * 32  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chained hash of one full block: sha256(parent hash || int32 token ids)."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int32).tobytes()).digest()


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block holds a registered full prefix block


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, least recently freed first; dict keys keep insertion order
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # chained hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref count 1), or None if fewer than n are free."""
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict the oldest cached prefix block
                del self._cached[block.hash]
                block.hash = None
            block.ref_count = 1
            ids.append(bid)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference from each block. Free them in reverse, so a sequence's tail blocks
        are evicted before the shared prefix blocks they extend."""
        for bid in reversed(ids):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise ValueError(f"block {bid} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[bid] = None

    def register(self, bid: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Record that block `bid`, in use and now full with `tokens`, extends `parent`.
        Returns its hash. If an equal block is already cached, the cache keeps the older one."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks ({self.block_size} tokens) can be registered")
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise ValueError(f"block {bid} is not in use")
        h = block_hash(parent, tokens)
        if h not in self._cached:
            self._cached[h] = bid
            block.hash = h
        return h

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], bytes]:
        """The longest run of cached full blocks that `tokens` starts with. Each is taken (ref
        count + 1, removed from the free queue). Returns (block ids, hash of the last matched
        block, or ROOT_HASH)."""
        ids, parent = [], ROOT_HASH
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            h = block_hash(parent, tokens[start:start + self.block_size])
            bid = self._cached.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
            ids.append(bid)
            parent = h
        return ids, parent
