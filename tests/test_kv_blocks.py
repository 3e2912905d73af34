"""KV block pool: allocation, chained hashing, prefix hits, eviction order, reclamation."""

from __future__ import annotations

import random

import pytest

from rvcompile.runtime.kv_blocks import ROOT_HASH, BlockPool, block_hash

BS = 4


def fill(pool: BlockPool, tokens: list[int]) -> tuple[list[int], bytes]:
    """A sequence's blocks as the engine makes them: reuse the cached prefix, allocate the rest,
    register every full block."""
    ids, parent = pool.match_prefix(tokens)
    need = -(-len(tokens) // BS) - len(ids)
    new = pool.allocate(need)
    assert new is not None
    for k, bid in enumerate(new, start=len(ids)):
        chunk = tokens[k * BS:(k + 1) * BS]
        if len(chunk) == BS:
            parent = pool.register(bid, parent, chunk)
    return ids + new, parent


def test_allocate_all_or_nothing_and_free() -> None:
    pool = BlockPool(5, BS)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2  # nothing taken
    pool.free(a)
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])


def test_hash_chains_over_the_parent() -> None:
    t = [5, 6, 7, 8]
    assert block_hash(ROOT_HASH, t) == block_hash(ROOT_HASH, list(t))
    assert block_hash(ROOT_HASH, t) != block_hash(block_hash(ROOT_HASH, t), t)
    assert block_hash(ROOT_HASH, t) != block_hash(ROOT_HASH, [5, 6, 7, 9])


def test_shared_prefix_is_reused_while_in_use() -> None:
    pool = BlockPool(8, BS)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    a, _ = fill(pool, prompt)
    b_ids, _ = pool.match_prefix(prompt + [99])
    assert b_ids == a[:2]  # the two full blocks, shared
    assert [pool.blocks[i].ref_count for i in a[:2]] == [2, 2]
    pool.free(b_ids)
    pool.free(a)
    assert pool.num_free == 8


def test_prefix_hit_after_free_and_lru_eviction() -> None:
    pool = BlockPool(4, BS)
    a, _ = fill(pool, [1, 2, 3, 4, 5, 6, 7, 8])  # 2 cached blocks
    pool.free(a)
    assert pool.num_free == 4 and pool.num_cached == 2
    hit, _ = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit == a and pool.num_free == 2  # taken back from the free queue
    pool.free(hit)
    # Freed in reverse: a[1] (the tail) is older in the queue than a[0]. Allocating 3 takes
    # the 2 never-used blocks first, then evicts the tail block a[1].
    got = pool.allocate(3)
    assert a[1] in got and a[0] not in got
    assert pool.num_cached == 1
    still, _ = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert still == [a[0]]  # the first block is still cached; the chain stops at the evicted one


def test_register_rejects_partial_or_free_blocks() -> None:
    pool = BlockPool(2, BS)
    (bid,) = pool.allocate(1)
    with pytest.raises(ValueError, match="full blocks"):
        pool.register(bid, ROOT_HASH, [1, 2])
    pool.free([bid])
    with pytest.raises(ValueError, match="not in use"):
        pool.register(bid, ROOT_HASH, [1, 2, 3, 4])


def test_duplicate_block_keeps_the_older_cache_entry() -> None:
    pool = BlockPool(4, BS)
    (x,) = pool.allocate(1)
    (y,) = pool.allocate(1)
    assert pool.register(x, ROOT_HASH, [1, 2, 3, 4]) == pool.register(y, ROOT_HASH, [1, 2, 3, 4])
    assert pool.num_cached == 1 and pool.blocks[y].hash is None
    assert pool.match_prefix([1, 2, 3, 4])[0] == [x]


def test_random_bursts_return_every_block() -> None:
    """Sequences with shared prefixes start, grow and finish in random order; afterwards every
    block is free again, reference counts are zero and every cached hash points at its block."""
    rng = random.Random(0)
    pool = BlockPool(64, BS)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 12]))] for _ in range(5)]
    live: list[list[int]] = []
    hits = 0
    for _ in range(500):
        if live and (rng.random() < 0.45 or pool.num_free < 8):
            pool.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(9))]
        ids, parent = pool.match_prefix(tokens)
        hits += len(ids)
        new = pool.allocate(-(-len(tokens) // BS) - len(ids))
        if new is None:
            pool.free(ids)
            continue
        for k, bid in enumerate(new, start=len(ids)):
            chunk = tokens[k * BS:(k + 1) * BS]
            if len(chunk) == BS:
                parent = pool.register(bid, parent, chunk)
        live.append(ids + new)
    for ids in live:
        pool.free(ids)
    assert hits > 100  # shared prefixes were actually reused
    assert pool.num_free == 64
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert all(pool.blocks[bid].hash == h for h, bid in pool._cached.items())
