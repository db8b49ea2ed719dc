"""BlockManager: bookkeeping of the paged KV cache (block tables, free queue, prefix cache).

Owned and called by the Scheduler (engine/scheduler.py) only; pure Python, it never
touches tensors. The model runner sees its decisions as the block ids in each
ScheduledRequest. Block hashes come from engine/block_hash.py; the manager keeps each
request's list (kept across preemption, dropped when the request finishes). It reads
requests and never writes them.

State:
- `blocks[i]`: every KV block with its `ref_cnt` (requests using it) and `block_hash`
  (set once the block is full and registered in the prefix cache).
- the free queue: blocks with ref_cnt 0, in eviction order (head = evicted first).
- the cache map `block_hash -> block`: full blocks whose KV can be reused. A freed block
  keeps its hash and stays findable until it is taken from the free queue for reuse
  ("evicted"); a hit revives it (ref_cnt 0 -> 1, out of the free queue).
- per request: its block table and how many of its blocks were considered for registration.

NOTE (null block): block 0 is reserved and never handed out. The runner pads block tables
with 0 and may point padded (CUDA-graph) token slots at it, so its contents are garbage by
design; keeping it out of the pool means no request ever reads what padding wrote.

NOTE (eviction order): free() releases a request's blocks tail first, so with LRU the end of
a sequence is evicted before its start (a start is the part other requests share). Freed
blocks that carry no hash (partial or duplicate blocks) can never be hit, so they go to the
head of the queue and are reused before any cached block is evicted.

NOTE (sharing): lookups and registration apply when prefix caching is enabled or when the
request carries a `cache_salt` (the engine salts n>1 siblings so they share their prompt even
with caching off; the salt keeps them private). Pooling requests neither look up nor register
(their runner path need not leave causal KV behind), and requests asking for prompt logprobs
do not look up (every prompt position must be computed to score it) but do register.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .block_hash import update_block_hashes
from .errors import ConfigError
from .request import Request

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None     # set while registered in the prefix cache

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ConfigError("kv_cache_memory", f"leaves room for {num_blocks} KV block(s); at least 2 are needed",
                              hint="give the KV cache more memory or lower the block size")
        assert block_size >= 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b.block_id != NULL_BLOCK_ID)
        self._cached: dict[int, KVBlock] = {}
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}      # per request: chained hashes of its full blocks
        # Prefix-cache stats, in tokens, counted once per admission of a request that looked up.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1    # minus the null block

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included: they are reclaimable)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._tables.get(request_id, ()))

    # ------------------------------------------------------------------ prefix cache
    def _shares(self, request: Request) -> bool:
        return (self.enable_prefix_caching or request.cache_salt is not None) and not request.is_pooling

    def _looks_up(self, request: Request) -> bool:
        return self._shares(request) and not request.needs_prompt_logprobs

    def get_computed_blocks(self, request: Request) -> tuple[tuple[KVBlock, ...], int]:
        """The longest run of cached full blocks that starts the request, and its token count.

        Rule: at most `(num_tokens - 1) // block_size` blocks may hit, so the last token is
        always computed (its logits give the next token) even when the whole prompt is cached.
        Looks only; nothing changes until allocate_slots() takes the blocks.
        """
        if not self._looks_up(request):
            return (), 0
        assert request.num_computed_tokens == 0 and request.request_id not in self._tables
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return tuple(hits), len(hits) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (), num_new_computed_tokens: int = 0) -> bool:
        """Grow the request's block table to hold `num_computed + num_new_computed + num_new` tokens.

        `new_computed_blocks` are prefix hits from get_computed_blocks() (first allocation only).
        Returns False, changing nothing, when the free queue is too short. Afterwards the
        request's newly full blocks are registered in the prefix cache (see the module NOTE).
        """
        table = self._tables.get(request.request_id)
        is_first = table is None
        assert is_first or not new_computed_blocks, "prefix hits are taken on the first allocation only"
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        table = [] if table is None else table
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed_blocks = -(-num_total_tokens // self.block_size)
        num_fresh = max(0, num_needed_blocks - len(table) - len(new_computed_blocks))
        # Hits on free (ref_cnt 0) blocks take them out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_fresh + num_revived > len(self._free_queue):
            return False

        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1
        table.extend(new_computed_blocks)
        for _ in range(num_fresh):
            table.append(self._take_free_block())
        self._tables[request.request_id] = table

        if is_first and self._looks_up(request):
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_new_computed_tokens
        if self._shares(request):
            self._register_full_blocks(request, table, min(num_total_tokens, request.num_tokens))
        return True

    def _take_free_block(self) -> KVBlock:
        _, block = self._free_queue.popitem(last=False)
        assert block.ref_cnt == 0
        if block.block_hash is not None:      # evict: no longer findable
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _register_full_blocks(self, request: Request, table: list[KVBlock], num_known_tokens: int) -> None:
        """Put the request's full blocks (whose tokens are known) into the cache map.

        NOTE: registration happens at allocation, before the step computes the KV, so a
        request admitted later in the same step may hit these blocks. That is safe because
        the runner writes the whole batch's KV into the cache (per layer) before attention
        reads it, and a request scheduled in a step is never preempted in that step.
        """
        num_full = num_known_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            block, block_hash = table[i], hashes[i]
            # A duplicate (the hash already maps to another block) stays unregistered: keep the first.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
        self._num_registered[request.request_id] = num_full

    def _block_hashes(self, request: Request) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return update_block_hashes(hashes, request, self.block_size)

    def block_hashes(self, request_id: str) -> tuple[int, ...]:
        """The request's block hashes computed so far (tests and debugging)."""
        return tuple(self._hashes.get(request_id, ()))

    def free(self, request: Request, *, finished: bool = True) -> None:
        """Release the request's blocks (tail first); safe to call for a request holding none.

        `finished=False` (preemption) keeps its block hashes: its tokens, so its hashes, stay."""
        if finished:
            self._hashes.pop(request.request_id, None)
        table = self._tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        for block in reversed(table or ()):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is None:
                    self._free_queue.move_to_end(block.block_id, last=False)


class NoKVCache:
    """The block manager's interface for models without a KV cache (encoder-only pooling models).

    Nothing to allocate, look up or free: every allocation succeeds and no request holds blocks,
    so the scheduler's budget is the step's token budget and `max_num_seqs` alone."""

    enable_prefix_caching = False
    num_queried_tokens = 0
    num_hit_tokens = 0
    usage = 0.0

    def get_computed_blocks(self, request: Request) -> tuple[tuple[KVBlock, ...], int]:
        return (), 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (), num_new_computed_tokens: int = 0) -> bool:
        return True

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        return ()

    def free(self, request: Request, *, finished: bool = True) -> None:
        pass
