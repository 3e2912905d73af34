"""Paged KV with prefix caching: `BlockPool`, the one owner of one kind's block ids, and `PagedKv`,
which keeps every sequence's blocks across the executor's KV kinds (executor_api).

Blocks hold `block_size` tokens. A full block may be registered under a chained hash: the hash
of its parent block's hash, its recipe (how its rows were computed, see scheduler.py) and its
own token ids, so equal prefixes computed the same way share blocks. A block's
reference count is the number of sequences using it. At zero it joins the free queue but keeps
its hash, and a later sequence with the same prefix can take it back (a prefix-cache hit).
`allocate` takes free blocks from the head of the queue (least recently freed first), evicting
their cached hash, and returns None when too few are free, so the scheduler can preempt. It never
allocates part of a request. Pure Python: no arrays, no device.

`PagedKv` holds one BlockPool per kind. Full-attention kinds keep every block of a sequence;
sliding kinds keep only the blocks a later token can still see (the window) and give the rest
back, still cached. A prefix hit needs, for every kind, the blocks the first new token reads: all
of them for full kinds, the window's for sliding kinds. So a shared system prompt is prefilled
once, sliding layers included.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rvcompile.runtime.executor_api import KvKind

ROOT_HASH = b"\x00" * 32  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int], recipe: bytes = b"") -> bytes:
    """Chained hash of one full block: sha256(parent hash || recipe || int32 token ids). The
    recipe says how the block's rows were computed, so a hit gives the bits a fresh run would."""
    return hashlib.sha256(parent + recipe + np.asarray(tokens, np.int32).tobytes()).digest()


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

    def register(self, bid: int, parent: bytes, tokens: Sequence[int],
                 recipe: bytes = b"") -> bytes:
        """Record that block `bid`, in use and now full with `tokens`, extends `parent`.
        Returns its hash. If an equal block is already cached, the cache keeps the older one."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks ({self.block_size} tokens) can be registered")
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise ValueError(f"block {bid} is not in use")
        h = block_hash(parent, tokens, recipe)
        if h not in self._cached:
            self._cached[h] = bid
            block.hash = h
        return h

    def cached(self, h: bytes) -> int | None:
        """The block registered under hash `h`, if it is still cached."""
        return self._cached.get(h)

    def take(self, bid: int) -> None:
        """Add a reference to block `bid` (a cached block found by `cached`)."""
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], bytes]:
        """The longest run of cached full blocks that `tokens` starts with. Each is taken (ref
        count + 1, removed from the free queue). Returns (block ids, hash of the last matched
        block, or ROOT_HASH)."""
        ids, parent = [], ROOT_HASH
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            h = block_hash(parent, tokens[start:start + self.block_size])
            bid = self.cached(h)
            if bid is None:
                break
            self.take(bid)
            ids.append(bid)
            parent = h
        return ids, parent


@dataclass
class SeqBlocks:
    """The KV blocks one sequence holds."""

    held: dict[str, dict[int, int]]  # kind -> logical block index -> block id
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each complete block
    # PagedKv.tables' result while `held` is unchanged (every step asks for it; PagedKv drops
    # it wherever it changes `held`)
    tables: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def count(self) -> int:
        return sum(len(h) for h in self.held.values())


class PagedKv:
    """Every sequence's KV blocks, over one BlockPool per kind."""

    def __init__(self, kinds: dict[str, KvKind], block_size: int):
        self.kinds, self.block_size = kinds, block_size
        self.pools = {k.name: BlockPool(k.num_blocks, block_size) for k in kinds.values()}

    def num_used(self, kind: str) -> int:
        return len(self.pools[kind].blocks) - self.pools[kind].num_free

    def empty(self) -> SeqBlocks:
        return SeqBlocks({k: {} for k in self.kinds})

    def _needed(self, kind: KvKind, first: int, end: int) -> range:
        """Logical blocks a step over positions [first, end) reads or writes."""
        lo = 0 if kind.window is None else max(0, first - kind.window + 1) // self.block_size
        return range(lo, -(-end // self.block_size))

    def match(self, tokens: Sequence[int],
              recipe: Callable[[int], bytes]) -> tuple[SeqBlocks, int]:
        """A new sequence over `tokens`, holding the longest cached prefix that every kind can
        resume from (at least the last token is left to run); `recipe(j)` says how the sequence
        would compute block j. Returns (blocks, cached tokens)."""
        bs = self.block_size
        hashes, parent = [], ROOT_HASH
        for j in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[j * bs:(j + 1) * bs], recipe(j))
            hashes.append(parent)
        n = len(hashes)
        while n > 0 and not all(self.pools[k.name].cached(hashes[j]) is not None
                                for k in self.kinds.values()
                                for j in self._needed(k, n * bs, n * bs)):
            n -= 1
        seq = self.empty()
        seq.hashes = hashes[:n]
        for k in self.kinds.values():
            for j in self._needed(k, n * bs, n * bs):
                bid = self.pools[k.name].cached(hashes[j])
                self.pools[k.name].take(bid)
                seq.held[k.name][j] = bid
        return seq, n * bs

    def ensure(self, seq: SeqBlocks, start: int, end: int) -> bool:
        """Give `seq` blocks for positions [start, end) in every kind, all or nothing. False
        when a pool has too few free blocks (the scheduler then preempts)."""
        bs = self.block_size
        needed = range(start // bs, -(-end // bs))
        missing = {}
        for name, held in seq.held.items():
            js = [j for j in needed if j not in held]
            if js:  # usually none: a decode step's blocks are held already
                missing[name] = js
        if any(len(js) > self.pools[name].num_free for name, js in missing.items()):
            return False
        for name, js in missing.items():
            for j, bid in zip(js, self.pools[name].allocate(len(js)), strict=True):
                seq.held[name][j] = bid
                seq.tables = None
        return True

    def commit(self, seq: SeqBlocks, tokens: Sequence[int], cached: int,
               recipe: Callable[[int], bytes] | None) -> None:
        """After a step: `cached` tokens of `tokens` are in the blocks. Register the blocks it
        completed under `recipe` (None: never share them) and give back sliding blocks no later
        token can see."""
        bs = self.block_size
        parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
        for j in range(len(seq.hashes), cached // bs if recipe else 0):
            block = tokens[j * bs:(j + 1) * bs]
            for name, held in seq.held.items():
                if j in held:
                    self.pools[name].register(held[j], parent, block, recipe(j))
            parent = block_hash(parent, block, recipe(j))
            seq.hashes.append(parent)
        for k in self.kinds.values():
            if k.window is not None:
                keep = self._needed(k, cached, cached).start
                gone = sorted(j for j in seq.held[k.name] if j < keep)
                if gone:
                    self.pools[k.name].free([seq.held[k.name].pop(j) for j in gone])
                    seq.tables = None

    def tables(self, seq: SeqBlocks) -> dict[str, np.ndarray]:
        """The executor's block tables of `seq` (see executor_api): int32 arrays, unused entries
        0, read-only (an executor stacks a call's tables with one copy). The same objects until
        `seq`'s blocks change."""
        if seq.tables is not None:
            return seq.tables
        out = {}
        for k in self.kinds.values():
            table = np.zeros(k.table_width, np.int32)
            entries = {j % k.table_width if k.ring else j: bid
                       for j, bid in seq.held[k.name].items()}
            if len(entries) < len(seq.held[k.name]):  # the ring is sized so this cannot be
                raise RuntimeError(f"two held {k.name} KV blocks share a ring entry")
            table[list(entries)] = list(entries.values())
            table.flags.writeable = False
            out[k.name] = table
        seq.tables = out
        return out

    def free(self, seq: SeqBlocks) -> None:
        """Give back every block of `seq`, tail first (so the prefix stays cached longest)."""
        for name, held in seq.held.items():
            self.pools[name].free([held[j] for j in sorted(held)])
            held.clear()
        seq.tables = None
