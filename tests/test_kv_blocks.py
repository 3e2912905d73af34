"""KV blocks: the pool of one kind (allocation, chained hashing, prefix hits, eviction order,
reclamation) and PagedKv over a full and a sliding kind (tables, window trimming, hits that need
every kind, recipes, all-or-nothing growth, no leaks)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rvcompile.runtime.executor_api import KvKind
from rvcompile.runtime.kv_blocks import ROOT_HASH, BlockPool, PagedKv, block_hash

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


# ---------------------------------------------------------------------------------------------
# PagedKv: a full kind and a sliding kind (window 6 tokens, ring of 4 blocks)

WINDOW = 6


def paged(full: int = 16, sliding: int = 8) -> PagedKv:
    return PagedKv({"full": KvKind("full", 8, False, None, full),
                    "sliding": KvKind("sliding", 4, True, WINDOW, sliding)}, BS)


def same_recipe(j: int) -> bytes:
    return b"r"


def grow(kv: PagedKv, seq, tokens: list[int], start: int, end: int) -> None:
    """Run positions [start, end) of tokens the way the scheduler does: blocks, then commit."""
    assert kv.ensure(seq, start, end)
    kv.commit(seq, tokens, end, same_recipe)


def test_sliding_kind_keeps_only_the_window_and_the_ring_table() -> None:
    kv = paged()
    tokens = list(range(100, 130))
    seq = kv.empty()
    for pos in range(len(tokens)):
        grow(kv, seq, tokens, pos, pos + 1)
        # the next token (at pos + 1) sees positions > pos + 1 - WINDOW: at most 3 blocks
        assert set(seq.held["sliding"]) == set(range(max(0, pos + 2 - WINDOW) // BS,
                                                     pos // BS + 1))
        assert sorted(seq.held["full"]) == list(range(pos // BS + 1))
    tables = kv.tables(seq)
    assert tables["full"][:len(seq.held["full"])].tolist() == [seq.held["full"][j]
                                                               for j in range(8)]
    for j, bid in seq.held["sliding"].items():  # logical block j sits at ring entry j % 4
        assert tables["sliding"][j % 4] == bid
    assert kv.num_used("sliding") == len(seq.held["sliding"]) <= 3
    kv.free(seq)
    assert kv.num_used("full") == kv.num_used("sliding") == 0


def test_tables_are_kept_until_the_blocks_change() -> None:
    kv = paged()
    tokens = list(range(100, 130))
    seq = kv.empty()

    def fresh() -> dict:
        kept, seq.tables = seq.tables, None
        out = listed(kv.tables(seq))
        seq.tables = kept
        return out

    def listed(tables: dict) -> dict:
        assert all(t.dtype == np.int32 and not t.flags.writeable for t in tables.values())
        return {k: t.tolist() for k, t in tables.items()}

    for pos in range(len(tokens)):
        before, held = kv.tables(seq), {k: dict(v) for k, v in seq.held.items()}
        grow(kv, seq, tokens, pos, pos + 1)  # a new block, or a sliding one given back, or none
        after = kv.tables(seq)
        assert listed(after) == fresh()
        assert (after is before) == (seq.held == held)  # recomputed exactly when blocks changed
    kv.free(seq)
    assert listed(kv.tables(seq)) == fresh() and set(kv.tables(seq)["full"].tolist()) == {0}
    # blocks given ahead (a decode loop's budget), then commits alone give sliding ones back
    seq = kv.empty()
    for pos in range(len(tokens)):
        if pos % 8 == 0:  # 8 positions ahead at a time, as much as the ring holds
            assert kv.ensure(seq, pos, pos + 8)
        kv.tables(seq)
        kv.commit(seq, tokens, pos + 1, same_recipe)
        assert listed(kv.tables(seq)) == fresh()


def test_hit_needs_every_kind_and_leaves_a_token_to_run() -> None:
    kv = paged()
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    a = kv.empty()
    grow(kv, a, prompt, 0, len(prompt))
    # Full blocks 0..3 are cached; sliding blocks before the window were given back but stay
    # cached, so a sequence resuming at 16 finds the window's blocks (2, 3) too.
    b, hit = kv.match(prompt, same_recipe)
    assert hit == 16 and sorted(b.held["full"]) == [0, 1, 2, 3]
    assert sorted(b.held["sliding"]) == [2, 3]
    assert b.held["full"] == {j: a.held["full"][j] for j in range(4)}
    # The whole prompt cached still leaves its last token to run: at most 16 of 16 tokens.
    c, hit_all = kv.match(prompt[:16], same_recipe)
    assert hit_all == 12
    # Without the sliding window's blocks there is no hit at that length.
    kv.free(a)
    kv.free(b)
    kv.free(c)
    sliding = kv.pools["sliding"]
    sliding.allocate(sliding.num_free)  # evicts every cached sliding block
    d, miss = kv.match(prompt, same_recipe)
    assert miss == 0 and d.count() == 0


def test_recipe_is_part_of_the_hash() -> None:
    kv = paged()
    prompt = list(range(1, 10))
    a = kv.empty()
    grow(kv, a, prompt, 0, len(prompt))
    _, hit = kv.match(prompt, same_recipe)
    assert hit == 8
    _, other = kv.match(prompt, lambda j: b"another")
    assert other == 0


def test_ensure_is_all_or_nothing_across_kinds() -> None:
    kv = paged(full=16, sliding=2)
    seq = kv.empty()
    assert not kv.ensure(seq, 0, 12)  # 3 sliding blocks needed, 2 in the pool
    assert seq.count() == 0 and kv.num_used("full") == kv.num_used("sliding") == 0
    assert kv.ensure(seq, 0, 8)
    assert seq.count() == 4


def test_random_sequences_return_every_block() -> None:
    """Sequences with shared prefixes grow chunk by chunk and end in random order, through hits
    and failed growth; afterwards both pools are whole and hold no references."""
    rng = random.Random(1)
    kv = paged(full=40, sliding=20)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([5, 9, 13]))] for _ in range(4)]
    live = []
    hits = 0
    for _ in range(400):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.randrange(len(live)))[0])
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(20))]
        seq, pos = kv.match(tokens, same_recipe)
        hits += pos
        while pos < len(tokens):
            end = min(len(tokens), pos + rng.randrange(1, 9))
            if not kv.ensure(seq, pos, end):
                break
            kv.commit(seq, tokens, end, same_recipe)
            pos = end
        live.append((seq, tokens))
    for seq, _ in live:
        kv.free(seq)
    assert hits > 50
    for pool in kv.pools.values():
        assert pool.num_free == len(pool.blocks)
        assert all(b.ref_count == 0 for b in pool.blocks)
