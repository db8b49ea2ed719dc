"""BlockManager and block hashes: pure Python, fake requests, hand-computed expectations."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vbatch.engine.block_hash import ROOT_HASH, hash_block, update_block_hashes
from vbatch.engine.block_manager import NULL_BLOCK_ID, BlockManager
from vbatch.engine.errors import ConfigError
from vbatch.engine.request import MultiModalFeature, Request
from vbatch.engine.sampling_params import SamplingParams

BS = 4  # block size used throughout: small, so hand counts stay readable


def make_request(rid: str, prompt: list[int], *, salt: str | None = None, prompt_logprobs: int | None = None,
                 mm: list[MultiModalFeature] | None = None) -> Request:
    params = SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs).resolve(eos_token_ids=[2], vocab_size=1000)
    return Request(rid, list(prompt), params, max_tokens=8, cache_salt=salt, mm_features=mm or [])


def admit(bm: BlockManager, req: Request, num_new: int | None = None) -> int:
    """What the scheduler does on admission; returns the hit in tokens."""
    blocks, num_hit = bm.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    assert bm.allocate_slots(req, num_new, blocks, num_hit)
    req.num_computed_tokens = num_hit + num_new
    return num_hit


def check_consistent(bm: BlockManager) -> None:
    """Ref counts equal the number of tables holding each block; free queue = blocks at ref 0."""
    holders = {b.block_id: 0 for b in bm.blocks}
    for table in bm._tables.values():
        for b in table:
            holders[b.block_id] += 1
    for b in bm.blocks:
        assert b.ref_cnt == holders[b.block_id], b
    assert set(bm._free_queue) == {b.block_id for b in bm.blocks if b.ref_cnt == 0 and b.block_id != NULL_BLOCK_ID}


# ---------------------------------------------------------------------------- hashes
def test_hash_chain_depends_on_parent_tokens_and_keys():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hash_block(ROOT_HASH, [1, 2, 3, 4])   # None means the root
    assert h0 != hash_block(None, [1, 2, 3, 5])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt:a",)) != h0
    assert hash_block(None, [1, 2, 3, 4], ("salt:a",)) != hash_block(None, [1, 2, 3, 4], ("salt:b",))


def test_request_hashes_cover_full_blocks_only_and_chain():
    req = make_request("a", list(range(10)))       # 2 full blocks + 2 tokens
    hashes = update_block_hashes([], req, BS)
    assert hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])]
    req.append_output_token(10)
    req.append_output_token(11)                     # the third block is now full
    assert update_block_hashes(hashes, req, BS) is hashes and len(hashes) == 3
    assert hashes[2] == hash_block(hashes[1], [8, 9, 10, 11])


def test_salt_joins_first_block_and_mm_identifiers_join_overlapping_blocks():
    plain = update_block_hashes([], make_request("a", list(range(12))), BS)
    salted = update_block_hashes([], make_request("b", list(range(12)), salt="s"), BS)
    assert all(p != s for p, s in zip(plain, salted))          # the chain carries the salt on
    img = MultiModalFeature("image", "img-1", offset=5, length=2)   # tokens 5, 6: block 1 only
    other = MultiModalFeature("image", "img-2", offset=5, length=2)
    h1 = update_block_hashes([], make_request("c", list(range(12)), mm=[img]), BS)
    h2 = update_block_hashes([], make_request("d", list(range(12)), mm=[other]), BS)
    assert h1[0] == plain[0] == h2[0]
    assert h1[1] != plain[1] and h1[1] != h2[1]


def test_hashes_are_stable_across_processes():
    code = ("from vbatch.engine.block_hash import hash_block; "
            "print(hash_block(hash_block(None, [1, 2], ('salt:x',)), [3, 4], ('mm:y',)))")
    values = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        values.add(int(out.stdout))
    assert values == {hash_block(hash_block(None, [1, 2], ("salt:x",)), [3, 4], ("mm:y",))}


# ---------------------------------------------------------------------------- allocation
def test_null_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=False)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    req = make_request("a", list(range(16)))
    admit(bm, req)
    assert sorted(bm.get_block_ids("a")) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0


def test_too_few_blocks_is_a_config_error():
    with pytest.raises(ConfigError):
        BlockManager(num_blocks=1, block_size=BS, enable_prefix_caching=True)


def test_allocate_grows_table_by_ceil_and_fails_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(5)))        # 5 tokens -> 2 blocks
    assert bm.allocate_slots(req, 5)
    assert len(bm.get_block_ids("a")) == 2
    req.num_computed_tokens = 5
    for t in (100, 101, 102):                       # decode 3 tokens: 8 tokens still fit 2 blocks
        req.append_output_token(t)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert len(bm.get_block_ids("a")) == 2
    req.append_output_token(103)
    assert bm.allocate_slots(req, 1)                 # token 9 needs block 3
    assert len(bm.get_block_ids("a")) == 3 and bm.num_free_blocks == 0
    req.num_computed_tokens += 1
    other = make_request("b", [7, 7])
    before = (bm.get_block_ids("a"), bm.num_free_blocks)
    assert not bm.allocate_slots(other, 2)
    assert (bm.get_block_ids("a"), bm.num_free_blocks) == before and bm.get_block_ids("b") == ()
    check_consistent(bm)


# ---------------------------------------------------------------------------- prefix cache
def test_hit_is_longest_full_block_prefix_and_never_the_last_token():
    bm = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    admit(bm, make_request("a", list(range(12))))   # registers 3 full blocks
    # Same 12 tokens: 3 blocks cached, but the last token must be computed: (12 - 1) // 4 = 2 blocks.
    assert admit(bm, make_request("b", list(range(12)))) == 8
    # 13 tokens sharing 12: all 3 blocks may hit ((13 - 1) // 4 = 3).
    assert admit(bm, make_request("c", list(range(13)))) == 12
    # Diverging in block 1: only block 0 hits.
    assert admit(bm, make_request("d", [0, 1, 2, 3, 4, 99, 6, 7, 8])) == 4
    # A different first block: nothing.
    assert admit(bm, make_request("e", [5] + list(range(1, 12)))) == 0
    check_consistent(bm)


def test_shared_blocks_return_to_the_free_queue_only_after_both_free():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(bm, a)
    assert admit(bm, b) == 8
    shared = bm.get_block_ids("a")[:2]
    assert bm.get_block_ids("b")[:2] == shared
    assert [bm.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert bm.num_free_blocks == 9 - 4                 # a: 3 blocks, b: 1 new block
    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert bm.num_free_blocks == 9 - 3
    bm.free(b)
    assert all(b.ref_cnt == 0 for b in bm.blocks) and bm.num_free_blocks == 9
    check_consistent(bm)


def test_freed_blocks_stay_findable_until_evicted_tail_first():
    bm = BlockManager(num_blocks=7, block_size=BS, enable_prefix_caching=True)   # 6 usable
    a = make_request("a", list(range(13)))          # 3 full blocks (cached) + 1 partial
    admit(bm, a)
    ids_a = bm.get_block_ids("a")
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # LRU reuse: the freed blocks are hit again, revived out of the free queue.
    b = make_request("b", list(range(13)))
    assert admit(bm, b) == 12
    assert bm.get_block_ids("b")[:3] == ids_a[:3]
    bm.free(b)
    # Free queue head: unhashed blocks first (the partial block; never used ones), then the
    # cached blocks from the tail of the sequence to its start.
    order = list(bm._free_queue)
    assert order[-3:] == [ids_a[2], ids_a[1], ids_a[0]]
    # A request needing 4 fresh blocks (3 unhashed + 1 evicted) evicts a's last full block only.
    c = make_request("c", [500 + i for i in range(16)])
    admit(bm, c)
    assert bm.num_cached_blocks == 2 + 4             # a's first two survive, plus c's 4 full blocks
    bm.free(c)
    d = make_request("d", list(range(13)))
    assert admit(bm, d) == 8                          # block 2 was evicted: hit stops at 2 blocks
    check_consistent(bm)


def test_eviction_under_pressure_removes_the_hit():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)   # 3 usable
    a = make_request("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    filler = make_request("f", [900 + i for i in range(12)])   # needs all 3 blocks: evicts everything
    admit(bm, filler)
    bm.free(filler)
    assert admit(bm, make_request("b", list(range(9)))) == 0


def test_duplicate_hash_keeps_the_first_block():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(8)))
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8)   # b skipped the lookup
    ids_a, ids_b = bm.get_block_ids("a"), bm.get_block_ids("b")
    assert bm.num_cached_blocks == 2
    assert all(bm.blocks[i].block_hash is None for i in ids_b)
    bm.free(b)
    assert set(list(bm._free_queue)[:2]) == set(ids_b)   # unhashed duplicates are reused first
    c = make_request("c", list(range(8)) + [1])
    assert admit(bm, c) == 8 and bm.get_block_ids("c")[:2] == ids_a
    check_consistent(bm)


def test_salt_separates_and_enables_sharing_with_caching_off():
    on = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    admit(on, make_request("a", list(range(9))))
    assert admit(on, make_request("s1", list(range(9)), salt="x")) == 0
    assert admit(on, make_request("s2", list(range(9)), salt="x")) == 8
    assert admit(on, make_request("s3", list(range(9)), salt="y")) == 0
    assert admit(on, make_request("u", list(range(9)))) == 8

    off = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=False)
    admit(off, make_request("a", list(range(9))))
    assert admit(off, make_request("b", list(range(9)))) == 0
    assert off.num_cached_blocks == 0
    admit(off, make_request("s1", list(range(9)), salt="x"))
    assert admit(off, make_request("s2", list(range(9)), salt="x")) == 8


def test_prompt_logprobs_skip_the_lookup_but_still_register():
    bm = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    admit(bm, make_request("a", list(range(9))))
    assert admit(bm, make_request("p", list(range(9)), prompt_logprobs=1)) == 0
    assert bm.num_queried_tokens == 9                 # p did not look up, so it is not a query
    bm2 = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    admit(bm2, make_request("p", list(range(9)), prompt_logprobs=1))
    assert admit(bm2, make_request("a", list(range(9)))) == 8


def test_chunked_allocation_registers_only_computed_full_blocks():
    bm = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    assert bm.allocate_slots(a, 6)                  # first chunk: tokens 0..5, one full block
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 6
    assert bm.allocate_slots(a, 6)
    assert bm.num_cached_blocks == 3


def test_stats_and_reset_prefix_cache():
    bm = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(bm, a)
    admit(bm, b)
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (18, 8)
    assert not bm.reset_prefix_cache()               # blocks in use
    bm.free(a)
    bm.free(b)
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0
    assert admit(bm, make_request("c", list(range(9)))) == 0
