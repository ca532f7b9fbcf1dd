"""Block manager: property-based tests over random allocate / append / fork / CoW / free / swap /
prefix-hit sequences, plus a few targeted cases.

Besides the bookkeeping invariants, the state machine simulates the KV pool's *contents*: each
slot written holds the token prefix its KV depends on, copy-on-write and swaps move that data as the model
runner would. After every step each sequence must read back exactly its own tokens through its
block table — which catches a wrong prefix-cache hit, a missed copy-on-write or a bad swap map.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from pagedllm.engine.block_manager import BlockManager

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # small alphabet: many prefix hits


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 16),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching):
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=caching)
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # seq -> tokens with KV computed
        self.swapped: set[int] = set()
        self.device: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.host: dict[int, list] = {b: [None] * block_size for b in range(num_cpu_blocks)}

    # ---- helpers: what the model runner would do ---------------------------------------------
    def _write(self, seq: int, start: int, new: list[int]) -> None:
        """A slot's KV depends on its token and every token before it: store that prefix."""
        table, bs = self.bm.tables[seq], self.bm.block_size
        context = self.tokens[seq] + new
        for position in range(start, start + len(new)):
            self.device[table[position // bs]][position % bs] = tuple(context[: position + 1])

    def _copy(self, pairs, src_pool, dst_pool) -> None:
        for src, dst in pairs:
            dst_pool[dst] = list(src_pool[src])

    def _compute(self, seq: int, new: list[int]) -> bool:
        start = len(self.tokens[seq])
        copies = self.bm.allocate_slots(seq, start, len(new))
        if copies is None:
            return False
        self._copy(copies, self.device, self.device)
        self._write(seq, start, new)
        self.tokens[seq] = self.tokens[seq] + new
        self.bm.cache_full_blocks(seq, self.tokens[seq], len(self.tokens[seq]))
        return True

    # ---- rules -------------------------------------------------------------------------------
    @rule(target=seqs, prompt=TOKENS)
    def add(self, prompt):
        seq = self.next_id
        self.next_id += 1
        cached = self.bm.allocate_prefix(seq, prompt)
        assert cached < len(prompt) and cached % self.bm.block_size == 0
        self.tokens[seq] = prompt[:cached]
        if not self._compute(seq, prompt[cached:]):
            self.bm.free(seq)
            del self.tokens[seq]
        return seq

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, new):
        running = sorted(set(self.tokens) - self.swapped)
        if running:
            self._compute(data.draw(st.sampled_from(running)), new)

    @precondition(lambda self: self.tokens)
    @rule(target=seqs, data=st.data())
    def fork(self, data):
        running = sorted(set(self.tokens) - self.swapped)
        if not running:
            return -1
        parent = data.draw(st.sampled_from(running))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.bm.free(seq)
            del self.tokens[seq]
            self.swapped.discard(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        running = sorted(set(self.tokens) - self.swapped)
        if not running:
            return
        seq = data.draw(st.sampled_from(running))
        pairs = self.bm.swap_out(seq)
        if pairs is not None:
            self._copy(pairs, self.device, self.host)
            self.swapped.add(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.can_swap_in(seq):
            self._copy(self.bm.swap_in(seq), self.host, self.device)
            self.swapped.discard(seq)
            self.bm.cache_full_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        bs = self.bm.block_size
        for seq, tokens in self.tokens.items():
            if seq in self.swapped:
                table, pool = self.bm.cpu_tables[seq], self.host
            else:
                table, pool = self.bm.tables[seq], self.device
            assert len(table) >= -(-len(tokens) // bs)
            for p in range(len(tokens)):
                read = pool[table[p // bs]][p % bs]
                assert read == tuple(tokens[: p + 1]), f"seq {seq} position {p} reads KV of {read}, expected {tokens[: p + 1]}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerProperties = BlockManagerMachine.TestCase


def test_prefix_hit_reuses_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert bm.allocate_prefix(1, tokens) == 0
    assert bm.allocate_slots(1, 0, 10) == []
    bm.cache_full_blocks(1, tokens, 10)
    # Same 8-token prefix: two full blocks are shared, counted as hits.
    assert bm.allocate_prefix(2, tokens[:8] + [99, 98]) == 8
    assert bm.tables[2] == bm.tables[1][:2]
    assert [bm.ref_counts[b] for b in bm.tables[1]] == [2, 2, 1]
    # A prompt that is exactly two cached blocks reuses only one: the last token must be computed.
    assert bm.allocate_prefix(3, tokens[:8]) == 4
    bm.check_invariants()


def test_cached_blocks_survive_free_and_are_evicted_last():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_prefix(1, [5, 6, 7])
    bm.allocate_slots(1, 0, 3)
    bm.cache_full_blocks(1, [5, 6, 7], 3)
    bm.free(1)
    assert bm.num_free_blocks == 4
    # The uncached free blocks are used before the cached one is evicted...
    bm.allocate_prefix(2, [1, 2, 3, 4, 9])
    bm.allocate_slots(2, 0, 5)
    assert bm.allocate_prefix(3, [5, 6, 7]) == 2  # ...so [5, 6] is still a hit
    bm.free(2)
    bm.free(3)
    bm.check_invariants()


@pytest.mark.parametrize("secure", [False, True])
def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_held(secure):
    bm = BlockManager(num_blocks=4, block_size=2, secure=secure)
    head, tail = cached_seq(bm, 1, [1, 2, 3])
    assert not bm.reset_prefix_cache()  # held: nothing changes
    assert bm.content[head] is not None
    bm.free(1)
    bm.take_blocks_to_zero()
    assert bm.reset_prefix_cache()
    assert bm.content[head] is None and bm.num_free_blocks == 4
    assert bm.take_blocks_to_zero() == (([head], []) if secure else ([], []))
    assert bm.allocate_prefix(2, [1, 2, 3]) == 0  # a miss now
    bm.check_invariants()


def test_copy_on_write_when_a_forked_partial_block_is_written():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate_prefix(1, [1, 2, 3, 4, 5, 6])
    bm.allocate_slots(1, 0, 6)
    bm.fork(1, 2)
    shared_tail = bm.tables[1][1]
    copies = bm.allocate_slots(2, 6, 1)
    assert copies == [(shared_tail, bm.tables[2][1])] and bm.tables[2][1] != shared_tail
    assert bm.allocate_slots(1, 6, 1) == []  # the last holder writes in place
    assert bm.tables[1][0] == bm.tables[2][0] and bm.ref_counts[bm.tables[1][0]] == 2
    bm.check_invariants()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate_prefix(1, [1])
    assert bm.allocate_slots(1, 0, 5) is None
    assert bm.tables[1] == [] and bm.num_free_blocks == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_pool_must_have_blocks(bad):
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=bad, block_size=16)


# ---- last-access LRU and secure mode (issue 31, item 5) -------------------------------------------
def cached_seq(bm: BlockManager, seq_id: int, tokens: list[int]) -> list[int]:
    """A sequence whose tokens are all computed and its full blocks published; its table."""
    bm.allocate_prefix(seq_id, tokens)
    bm.allocate_slots(seq_id, 0, len(tokens))
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return list(bm.tables[seq_id])


def test_eviction_takes_the_least_recently_accessed_not_the_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = cached_seq(bm, 1, [1, 2, 3, 4])  # read at step 1 only
    bm.touch(1)
    bm.tick()
    recent = cached_seq(bm, 2, [5, 6, 7, 8])  # read at step 2
    bm.touch(2)
    bm.free(2)  # freed first, but read last
    bm.free(1)
    assert bm.num_free_blocks == 4 and all(bm.content[b] is not None for b in old + recent)
    bm.allocate_prefix(3, [9, 9, 9, 9, 9])
    bm.allocate_slots(3, 0, 4)  # two blocks: least-recently-freed would take `recent`'s
    assert sorted(bm.tables[3]) == sorted(old)
    assert bm.allocate_prefix(4, [5, 6, 7, 8, 0]) == 4  # `recent` is still a hit
    bm.check_invariants()


def test_blocks_read_in_the_same_step_go_tail_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    head, tail = cached_seq(bm, 1, [1, 2, 3, 4])
    bm.touch(1)
    bm.free(1)
    bm.allocate_prefix(2, [7])
    bm.allocate_slots(2, 0, 1)  # the uncached block
    bm.allocate_slots(2, 1, 2)  # then the tail (freed before the head)
    assert bm.tables[2][1] == tail and bm.content[head] is not None


def test_secure_mode_zeroes_freed_blocks_but_not_cached_ones_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=2, secure=True)
    head, tail = cached_seq(bm, 1, [1, 2, 3])  # [1, 2] cached, [3] partial
    bm.free(1)
    assert bm.take_blocks_to_zero() == ([tail], [])  # the cached head keeps its content
    assert bm.take_blocks_to_zero() == ([], [])
    bm.allocate_prefix(2, [5, 6, 7, 8, 9, 9, 9])
    bm.allocate_slots(2, 0, 7)  # four blocks: the three uncached, then the head is evicted
    assert head in bm.tables[2] and bm.content[head] is None
    assert bm.take_blocks_to_zero() == ([head], [])
    plain = BlockManager(num_blocks=4, block_size=2)
    cached_seq(plain, 1, [1, 2, 3])
    plain.free(1)
    assert plain.take_blocks_to_zero() == ([], [])


def test_secure_mode_zeroes_freed_host_blocks_unless_a_swap_out_overwrites_them():
    bm = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=4, secure=True, enable_prefix_caching=False)
    cached_seq(bm, 1, [1, 2, 3])
    bm.swap_out(1)
    bm.take_blocks_to_zero()
    read_back = [host for host, _ in bm.swap_in(1)]
    assert sorted(bm.take_blocks_to_zero()[1]) == sorted(read_back)  # zeroed after the swap-in read them
    bm.swap_out(1)
    bm.free(1)  # ends while swapped out: its two host blocks are queued
    cached_seq(bm, 2, [4])
    (_, taken), = bm.swap_out(2)  # takes one of them, and overwrites all of it
    host = bm.take_blocks_to_zero()[1]
    assert len(host) == 1 and taken not in host
    bm.check_invariants()


# ---- cases found by mutation testing (issue 45, `make mutate`) --------------------------------------
@pytest.mark.parametrize("corrupt, message", [
    (lambda bm: bm.ref_counts.__setitem__(bm.tables[1][0], 2), "ref counts differ from the tables holding the blocks"),
    (lambda bm: bm._free_uncached.append(bm._free_uncached[0]), "a block is free twice"),
    (lambda bm: bm.tables.__setitem__(9, [bm._free_uncached[0]]) or bm.ref_counts.__setitem__(bm._free_uncached[0], 1),
     "a free block is referenced"),
    (lambda bm: bm._free_uncached.remove(bm._free_uncached[0]), None),
    (lambda bm: bm._evictable.__setitem__(bm._free_uncached.pop(), 99), "an uncached block is evictable"),
    (lambda bm: bm._hash_to_block.__setitem__(12345, bm.tables[1][0]), None),
    (lambda bm: bm._hash_to_block.__setitem__(12345, bm._free_uncached[0]), None),
    (lambda bm: bm._cpu_free.append(bm._cpu_free[0]), None),
    (lambda bm: bm._cpu_free.pop(), None),
    (lambda bm: bm.cpu_tables.__setitem__(7, [bm._cpu_free[0]]), None),
    (lambda bm: bm.cpu_tables.__setitem__(7, [bm._cpu_free.pop()]) or bm.cpu_tables.__setitem__(8, bm.cpu_tables[7]), None),
    (lambda bm: bm.cpu_tables.__setitem__(7, [bm._cpu_free.pop(), bm._cpu_free.pop()][:1] * 2), None),  # counts add up
])
def test_check_invariants_catches_each_broken_invariant(corrupt, message):
    """The tests' oracle: each corruption of the bookkeeping fails it (with its message where it has one)."""
    bm = BlockManager(num_blocks=6, block_size=2, num_cpu_blocks=3)
    cached_seq(bm, 1, [1, 2, 3])
    bm.check_invariants()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message and f"^{message}$"):
        bm.check_invariants()


def test_the_eviction_heap_stays_proportional_to_the_cached_free_blocks():
    """Each prefix hit on a cached free block leaves its heap entry stale; they are dropped once
    they outnumber the live ones (2 x live + 64), and eviction still takes the right block."""
    bm = BlockManager(num_blocks=8, block_size=2)
    cached_seq(bm, 1, [1, 2, 3, 4, 5, 6, 7])
    bm.free(1)
    sizes = []
    for seq_id in range(2, 202):
        assert bm.allocate_prefix(seq_id, [1, 2, 3, 4, 5, 6, 7]) == 6
        bm.free(seq_id)
        sizes.append(len(bm._eviction_heap))
    assert len(bm._evictable) == 3 and max(sizes) == 66 and min(sizes[100:]) == 3  # 2 x 1 + 64 as the tail's entry goes in
    bm.check_invariants()
    taken = [bm._pop_free() for _ in range(8)]  # the cached blocks go last, when nothing else is free
    assert all(bm.content[b] is None for b in taken) and bm._hash_to_block == {} and not bm._evictable


def test_prefix_queries_and_hits_are_counted_in_tokens_only_with_caching():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.clock) == (0, 0, 0)
    bm.record_prefix_query(9, 4)
    bm.record_prefix_query(3, 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12, 4)
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    off.record_prefix_query(9, 4)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_access_stamps_follow_the_clock_across_several_steps():
    """Three cached sequences last read at steps 1, 3 and 2: freed together, their blocks are
    evicted in that order of access, whatever the order they were freed in."""
    bm = BlockManager(num_blocks=3, block_size=2)
    blocks = {}
    for seq_id, step in ((1, 1), (2, 3), (3, 2)):
        blocks[seq_id] = cached_seq(bm, seq_id, [seq_id * 10, seq_id * 10 + 1])[0]
    for step in (1, 2, 3):
        bm.tick()
        for seq_id, last in ((1, 1), (2, 3), (3, 2)):
            if step == last:
                bm.touch(seq_id)
    assert bm.clock == 3
    for seq_id in (2, 1, 3):
        bm.free(seq_id)
    assert [bm.last_access[blocks[s]] for s in (1, 2, 3)] == [1, 3, 2]
    assert [bm._pop_free() for _ in range(3)] == [blocks[1], blocks[3], blocks[2]]


def test_requeued_blocks_are_zeroed_with_the_next_step_only_in_secure_mode():
    secure = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=2, secure=True)
    secure.requeue_zero([3, 1], [0])
    assert secure.take_blocks_to_zero() == ([3, 1], [0]) and secure.take_blocks_to_zero() == ([], [])
    plain = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=2)
    plain.requeue_zero([3, 1], [0])
    assert plain.take_blocks_to_zero() == ([], [])


def test_swap_out_and_in_map_every_block_and_refuse_when_the_host_is_short():
    bm = BlockManager(num_blocks=6, block_size=2, num_cpu_blocks=3)
    table = cached_seq(bm, 1, [1, 2, 3, 4, 5])  # 3 blocks
    cached_seq(bm, 2, [9])
    assert len(bm.swap_out(2)) == 1
    assert bm.swap_out(1) is None and bm.tables[1] == table  # 3 blocks, 2 host blocks left
    bm.swap_in(2)
    pairs = bm.swap_out(1)
    assert [device for device, _ in pairs] == table and len({cpu for _, cpu in pairs}) == 3
    assert bm.cpu_tables[1] == [cpu for _, cpu in pairs] and 1 not in bm.tables and bm._seq_hashes[1] == []
    assert bm.num_free_cpu_blocks == 0 and not bm.can_swap_in(1, extra_blocks=3) and bm.can_swap_in(1, extra_blocks=2)
    back = bm.swap_in(1)
    assert [cpu for cpu, _ in back] == [cpu for _, cpu in pairs] and bm.tables[1] == [device for _, device in back]
    assert bm.num_free_cpu_blocks == 3
    bm.check_invariants()


def test_slots_needed_counts_a_copy_on_write_for_a_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    cached_seq(bm, 1, [1, 2, 3, 4, 5, 6])  # 2 blocks, the second partly filled
    assert bm.slots_needed(1, 6, 2) == 0 and bm.slots_needed(1, 6, 3) == 1 and bm.slots_needed(1, 8, 1) == 1
    bm.fork(1, 2)
    assert bm.slots_needed(2, 6, 1) == 1 and bm.slots_needed(2, 6, 3) == 2 and bm.slots_needed(2, 8, 1) == 1
    assert bm.slots_needed(1, 4, 1) == 0  # a full shared block is not written: no copy
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2


def test_free_releases_tail_first_and_forgets_the_sequence():
    bm = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=2)
    head, tail = cached_seq(bm, 1, [1, 2, 3, 4])
    bm.touch(1)
    bm.free(1)
    assert 1 not in bm.tables and 1 not in bm._seq_hashes and 1 not in bm._last_scheduled
    assert bm._evictable[tail] < bm._evictable[head]  # the tail was released first
    bm.free(1)  # twice: nothing happens
    bm.check_invariants()


def test_a_pool_of_one_block_works_and_a_double_release_is_caught():
    bm = BlockManager(num_blocks=1, block_size=2)
    assert bm.num_free_cpu_blocks == 0 and bm.num_cpu_blocks == 0  # no host pool by default
    bm.allocate_prefix(1, [1])
    assert bm.allocate_slots(1, 0, 2) == [] and bm.num_free_blocks == 0
    block = bm.tables[1][0]
    bm.free(1)
    with pytest.raises(AssertionError, match=f"^block {block} released more often than acquired$"):
        bm._release(block, 1)


def test_a_sequence_never_scheduled_stamps_its_blocks_oldest():
    """Freed after one read at step 1, an unscheduled sequence's blocks (stamp 0) still go first."""
    bm = BlockManager(num_blocks=2, block_size=2)
    read = cached_seq(bm, 1, [1, 2])[0]
    unread = cached_seq(bm, 2, [3, 4])[0]
    bm.tick()
    bm.touch(1)
    bm.free(1)
    bm.free(2)
    assert [bm._pop_free(), bm._pop_free()] == [unread, read]


def test_swap_out_and_copy_on_write_release_with_the_sequences_stamp():
    bm = BlockManager(num_blocks=6, block_size=2, num_cpu_blocks=4)
    head = cached_seq(bm, 1, [1, 2, 3])[0]
    bm.fork(1, 2)
    bm.fork(1, 3)
    for _ in range(3):
        bm.tick()
    for seq_id in (1, 2, 3):
        bm.touch(seq_id)
    bm.swap_out(3)  # releases its share of the blocks, read at step 3
    assert bm.last_access[head] == 3
    bm.tick()
    bm.touch(2)
    shared = bm.tables[2][1]
    bm.allocate_slots(2, 3, 1)  # the partly filled block is copied on write: 2 lets go of it
    assert bm.last_access[shared] == 4
