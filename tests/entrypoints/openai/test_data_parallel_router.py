"""The data-parallel router alone: prefix keys chain like the prefix cache's, load is given back exactly,
a remembered prefix wins within one step's budget and loses beyond it."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.data_parallel import MAX_GROUP_SKEW, MAX_PREFIX_BLOCKS, PrefixRouter, prefix_keys


def test_prefix_keys_chain_over_full_blocks_only():
    a = prefix_keys(list(range(40)), 16)
    b = prefix_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block does not count
    c = prefix_keys([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every key after it
    assert len(prefix_keys(list(range(16 * 20)), 16)) == MAX_PREFIX_BLOCKS


def test_a_remembered_prefix_wins_within_the_slack_and_loses_beyond_it():
    router = PrefixRouter(2, block_size=4, slack_tokens=10)
    prompt = list(range(12))
    index, reason, keys = router.choose(prompt, [0, 1])
    assert (index, reason) == (0, "load")
    router.assign(index, keys, 8)
    again, reason, _ = router.choose(prompt + [5, 6], [0, 1])
    assert (again, reason) == (0, "prefix")  # 8 tokens ahead of replica 1: within the slack
    router.assign(0, keys, 8)
    assert router.choose(prompt, [0, 1])[:2] == (1, "load")  # 16 ahead: beyond it
    router.release(0, 8)
    assert router.choose(prompt, [1])[:2] == (1, "load")  # replica 0 down
    router.forget(0)
    router.release(0, 8)
    assert router.choose(prompt, [0, 1])[:2] == (0, "load")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=24), st.integers(1, 50)), max_size=30),
       st.integers(1, 4))
def test_load_returns_to_zero_and_the_choice_is_available(requests, size):
    router = PrefixRouter(size, block_size=4, slack_tokens=16)
    held = []
    for i, (prompt, tokens) in enumerate(requests):
        available = [r for r in range(size) if (r + i) % 3 or size == 1] or [0]
        index, reason, keys = router.choose(prompt, available)
        assert index in available and reason in ("prefix", "load")
        if reason == "load":
            assert router.load[index] == min(router.load[r] for r in available)
        router.assign(index, keys, tokens)
        held.append((index, tokens))
    for index, tokens in held:
        router.release(index, tokens)
    assert router.load == [0] * size and router.groups == [0] * size


def test_24_chats_sharing_a_system_prefix_keep_both_replicas_busy():
    """Chats share the template's system prompt and ask for few tokens: within the token slack all
    24 went to one replica (issue 44); the group bound spreads them, each still near its prefix."""
    system = list(range(100, 164))  # 64 tokens of system prompt: 4 blocks of 16
    router = PrefixRouter(2, block_size=16, slack_tokens=2048)
    sent = []
    for chat in range(24):  # all in flight at once: nothing released
        index, reason, keys = router.choose(system + [chat] * 20, [0, 1])
        router.assign(index, keys, 84 + 32)
        sent.append((index, reason))
    per_replica = [sum(1 for i, _ in sent if i == r) for r in (0, 1)]
    assert min(per_replica) >= 11 and abs(per_replica[0] - per_replica[1]) <= MAX_GROUP_SKEW, per_replica
    assert sum(1 for _, reason in sent if reason == "prefix") >= 20  # both replicas hold the prefix and are reused
