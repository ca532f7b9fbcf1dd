"""KV block manager: free list, ref counts, prefix cache, copy-on-write fork and swap maps.

Allocation, append, free and fork of block tables. Physical device blocks are shared by ref count; a block is
*free* when nothing references it. Free blocks that still hold a full, hashed prefix stay in the
prefix cache until they are reused: those are evicted after every free block without cached
content has been used, least recently *accessed* first (the design's `last_accessed`): the
scheduler stamps each sequence it schedules with its step clock (`touch`, `tick`: O(1) a
sequence, not a walk over its table every step) and a block takes the latest stamp of the
sequences that held it as each of them lets it go (`_release`), so a prefix that a sequence kept reading stays cached longer than one that sat unread in a
table until its sequence ended. Ties (blocks last read in the same step) go least recently
freed first, so a sequence's head, freed last, outlives its tail.

Secure mode (design 001 Algorithm 2, SECURE_MODE) keeps one tenant's KV from being read by the
next: a block whose last reference goes and that holds no cached prefix is queued for zeroing,
and so is a cached block when it is evicted to be handed out; host swap blocks are queued when
freed. The block manager only decides: the scheduler passes the queues to the runner in the
step (`SchedulerOutput.blocks_to_zero`, `host_blocks_to_zero`), which zeroes them before the
step writes anything into them. A cached block stays intact while cached: its content is what
a later prefix hit reuses.

The prefix cache is keyed by a hash chained over the parent block (nano-vLLM's scheme), and the
block's token ids are compared on a hit so that a hash collision can never serve wrong KV.
Block tables live here, keyed by sequence id, so that every invariant (ref count == number of
tables holding the block, used + free == total) can be checked in one place.
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

import xxhash

from pagedllm.step.scheduler_output import BlockPairs


def _chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    h = xxhash.xxh64(parent.to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return h.intdigest()


@dataclass
class _CachedContent:
    hash: int
    tokens: tuple[int, ...]
    root: int = 0  # the chain's root: the adapter id whose KV the block holds (0: the base model)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, enable_prefix_caching: bool = True,
                 secure: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.content: list[_CachedContent | None] = [None] * num_blocks
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks -> their entry's release number; the heap orders them for eviction by
        # (last access, release number). An entry whose number no longer matches is stale.
        self._evictable: dict[int, int] = {}
        self._eviction_heap: list[tuple[int, int, int]] = []
        self._releases = 0
        self.clock = 0  # the scheduler's step counter
        self.last_access = [0] * num_blocks  # of a block, settled when a holder releases it
        self._last_scheduled: dict[int, int] = {}  # seq_id -> the step it was last scheduled in
        self.secure = secure
        self._to_zero: dict[int, None] = {}  # device blocks to zero before reuse (an ordered set)
        self._to_zero_cpu: dict[int, None] = {}
        self._hash_to_block: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self._seq_hashes: dict[int, list[int]] = {}
        self._roots: dict[int, int] = {}  # seq_id -> its adapter id (its hash chain's root)
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_tables: dict[int, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    # ---- prefix cache ------------------------------------------------------------------------
    def _lookup(self, token_ids: list[int], root: int = 0) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks that prefixes `token_ids[:-1]`, computed under
        adapter `root` (0: the base model): the same tokens under another adapter have other KV,
        so the adapter id is the chain's first parent and is compared on a hit like the tokens.

        The last token is never served from cache: its logits are needed to sample."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        parent = root
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            parent = _chain_hash(parent, tokens)
            block = self._hash_to_block.get(parent)
            if block is None or self.content[block].tokens != tokens or self.content[block].root != root:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def allocate_prefix(self, seq_id: int, token_ids: list[int], use_cache: bool = True, root: int = 0) -> int:
        """Start a block table for a new (or recomputed) sequence computed under adapter `root`
        (0: the base model); returns cached tokens reused."""
        assert seq_id not in self.tables, f"sequence {seq_id} already has a block table"
        self._roots[seq_id] = root
        blocks, hashes = self._lookup(token_ids, root) if use_cache else ([], [])
        for block in blocks:
            self._acquire(block)
        self.tables[seq_id] = blocks
        self._seq_hashes[seq_id] = hashes
        return len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted prompt's lookup (vLLM counts these stats in tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Publish blocks whose every token now has KV, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        hashes = self._seq_hashes[seq_id]
        bs = self.block_size
        root = self._roots.get(seq_id, 0)
        for index in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            block_hash = _chain_hash(hashes[-1] if hashes else root, tokens)
            hashes.append(block_hash)
            block = table[index]
            if block_hash not in self._hash_to_block and self.content[block] is None:
                self.content[block] = _CachedContent(block_hash, tokens, root)
                self._hash_to_block[block_hash] = block

    # ---- allocation --------------------------------------------------------------------------
    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        if self._free_uncached:
            block = self._free_uncached.pop()
        else:
            block = self._evict()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _evict(self) -> int:
        """The cached free block read least recently (then freed least recently), its cache entry
        dropped; in secure mode its content is queued for zeroing, as it leaves the cache."""
        while True:
            _, release, block = heapq.heappop(self._eviction_heap)
            if self._evictable.get(block) == release:
                break
        del self._evictable[block]
        del self._hash_to_block[self.content[block].hash]
        self.content[block] = None
        if self.secure:
            self._to_zero[block] = None
        return block

    def _release(self, block: int, seq_id: int) -> None:
        """`seq_id` lets go of `block`: the block was last read no earlier than it was last scheduled."""
        assert self.ref_counts[block] > 0, f"block {block} released more often than acquired"
        self.last_access[block] = max(self.last_access[block], self._last_scheduled.get(seq_id, 0))
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.content[block] is not None:
                self._releases += 1
                self._evictable[block] = self._releases
                heapq.heappush(self._eviction_heap, (self.last_access[block], self._releases, block))
                self._compact_eviction_heap()
            else:
                self._free_uncached.append(block)
                if self.secure:
                    self._to_zero[block] = None

    def _compact_eviction_heap(self) -> None:
        """Drop stale entries (blocks taken back by prefix hits) once they outnumber live ones, so
        the heap stays proportional to the cached free blocks however long the engine runs."""
        if len(self._eviction_heap) > 2 * len(self._evictable) + 64:
            self._eviction_heap = [e for e in self._eviction_heap if self._evictable.get(e[2]) == e[1]]
            heapq.heapify(self._eviction_heap)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): later prompts compute their
        KV afresh, as a benchmark's repeated runs of the same prompts should. Only while no block
        is held (False, nothing changed, otherwise: a running sequence's blocks stay as they are);
        in secure mode the forgotten blocks are zeroed before reuse, as evicted ones are."""
        if self.num_used_blocks:
            return False
        for block in self._evictable:
            self.content[block] = None
            self._free_uncached.append(block)
            if self.secure:
                self._to_zero[block] = None
        self._evictable.clear()
        self._eviction_heap.clear()
        self._hash_to_block.clear()
        return True

    # ---- access times and zeroing ------------------------------------------------------------
    def tick(self) -> None:
        """A new scheduler step: accesses from now on are stamped with a later time."""
        self.clock += 1

    def touch(self, seq_id: int) -> None:
        """The sequence's blocks are read this step (it is scheduled); they take the stamp when released."""
        self._last_scheduled[seq_id] = self.clock

    def take_blocks_to_zero(self) -> tuple[list[int], list[int]]:
        """(device blocks, host blocks) queued for zeroing since the last call; empty unless secure."""
        device, host = list(self._to_zero), list(self._to_zero_cpu)
        self._to_zero.clear()
        self._to_zero_cpu.clear()
        return device, host

    def requeue_zero(self, device: list[int], host: list[int]) -> None:
        """Blocks a step that failed was to zero: zeroed with the next step instead (a block
        zeroed twice is still zero; one handed out meanwhile is zeroed before it is written)."""
        if self.secure:
            self._to_zero.update(dict.fromkeys(device))
            self._to_zero_cpu.update(dict.fromkeys(host))

    def _free_cpu(self, cpu_blocks: list[int]) -> None:
        self._cpu_free.extend(cpu_blocks)
        if self.secure:
            self._to_zero_cpu.update(dict.fromkeys(cpu_blocks))

    def _pop_cpu(self) -> int:
        """A host block for a swap-out, which overwrites all of it: no zeroing needed any more."""
        block = self._cpu_free.pop()
        self._to_zero_cpu.pop(block, None)
        return block

    def slots_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """New blocks needed to write tokens [num_computed, num_computed + num_new)."""
        table = self.tables[seq_id]
        needed = max(0, self.blocks_for(num_computed + num_new) - len(table))
        if num_computed % self.block_size and self.ref_counts[table[num_computed // self.block_size]] > 1:
            needed += 1  # the partly filled block is shared: copy-on-write
        return needed

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> BlockPairs | None:
        """Grow a table to hold `num_new` more tokens; None (and no change) if the pool is short.

        Returns the (src, dst) block copies that copy-on-write requires before the write."""
        if self.slots_needed(seq_id, num_computed, num_new) > self.num_free_blocks:
            return None
        table = self.tables[seq_id]
        copies: BlockPairs = []
        index = num_computed // self.block_size
        if num_computed % self.block_size and self.ref_counts[table[index]] > 1:
            new_block = self._pop_free()
            copies.append((table[index], new_block))
            self._release(table[index], seq_id)
            table[index] = new_block
        while len(table) < self.blocks_for(num_computed + num_new):
            table.append(self._pop_free())
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """Share every block of the parent (a fork); writes go through CoW."""
        assert child_id not in self.tables
        table = list(self.tables[parent_id])
        for block in table:
            self._acquire(block)
        self.tables[child_id] = table
        self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])
        self._roots[child_id] = self._roots.get(parent_id, 0)

    def free(self, seq_id: int) -> None:
        """Release a sequence's device blocks (tail first, so shared heads stay cached longest)."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self._release(block, seq_id)
        self._last_scheduled.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        self._free_cpu(self.cpu_tables.pop(seq_id, []))

    # ---- swap --------------------------------------------------------------------------------
    def swap_out(self, seq_id: int) -> BlockPairs | None:
        """Move a sequence's blocks to host memory: (device, cpu) copies, or None if it won't fit."""
        table = self.tables[seq_id]
        if len(table) > len(self._cpu_free):
            return None
        pairs = [(block, self._pop_cpu()) for block in table]
        self.cpu_tables[seq_id] = [cpu for _, cpu in pairs]
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block, seq_id)
        self._seq_hashes[seq_id] = []  # fresh device blocks will be re-published after swap-in
        return pairs

    def can_swap_in(self, seq_id: int, extra_blocks: int = 0) -> bool:
        return len(self.cpu_tables[seq_id]) + extra_blocks <= self.num_free_blocks

    def swap_in(self, seq_id: int) -> BlockPairs:
        """Bring a swapped sequence back: (cpu, device) copies into freshly allocated blocks."""
        assert self.can_swap_in(seq_id)
        cpu_table = self.cpu_tables.pop(seq_id)
        pairs = [(cpu, self._pop_free()) for cpu in cpu_table]
        self.tables[seq_id] = [device for _, device in pairs]
        self._free_cpu(list(reversed(cpu_table)))
        return pairs

    # ---- invariants (tests) ------------------------------------------------------------------
    def check_invariants(self) -> None:
        holders = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                holders[block] += 1
        assert holders == self.ref_counts, "ref counts differ from the tables holding the blocks"
        free = set(self._free_uncached) | set(self._evictable)
        assert len(free) == len(self._free_uncached) + len(self._evictable), "a block is free twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block is referenced"
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        assert sum(1 for r in self.ref_counts if r > 0) == self.num_used_blocks
        assert all(self.content[b] is not None for b in self._evictable), "an uncached block is evictable"
        for block_hash, block in self._hash_to_block.items():
            assert self.content[block] is not None and self.content[block].hash == block_hash
        cpu_used = [b for t in self.cpu_tables.values() for b in t]
        assert len(cpu_used) == len(set(cpu_used)) and not set(cpu_used) & set(self._cpu_free)
        assert len(cpu_used) + len(self._cpu_free) == self.num_cpu_blocks
