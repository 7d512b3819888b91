"""Routing policies by name (``kvwarm.cluster.routing``), the prefix-affinity policy and
conversation chains, without Ray: candidates and stats in, ranked replica groups out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import pytest

from kvwarm.cluster.chains import LastRows, chat_chain, text_chain
from kvwarm.cluster.routing import (
    AffinityTable,
    Decision,
    PrefixPolicy,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    WarmSet,
    build_policy,
    match_length,
    register_policy,
    registered_policies,
    unregister_policy,
)
from kvwarm.errors import ConfigError
from kvwarm.settings import Settings

UNKNOWN = r"unknown routing policy 'nope'; expected one of .*prefix"
CONFIG = RoutingConfig(busy_requests=2, slow_factor=3.0, slow_floor_ms=1000.0)


def rank(chain: Sequence[str], views: Sequence[ReplicaView]) -> Decision:
    return PrefixPolicy(CONFIG).rank(RouteRequest(tuple(chain)), views)


MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "how are you?"},
]


def test_chat_chain_is_chained_at_message_boundaries() -> None:
    full = chat_chain("m", MSGS)
    assert len(full) == 3  # the system message is the seed, not a unit
    # A follow-up's chain starts with the earlier turn's chain, whatever comes after.
    assert chat_chain("m", MSGS[:2]) == full[:1]
    assert chat_chain("m", [*MSGS, {"role": "assistant", "content": "fine"}])[:3] == full
    # One changed message changes its hash and every later one, never an earlier one.
    edited = [*MSGS[:2], {"role": "assistant", "content": "HI"}, MSGS[3]]
    other = chat_chain("m", edited)
    assert other[0] == full[0]
    assert all(a != b for a, b in zip(other[1:], full[1:], strict=True))
    # Null fields (an echoed assistant message) do not change the hash.
    echoed = [*MSGS[:2], {"role": "assistant", "content": "hi", "tool_calls": None}, MSGS[3]]
    assert chat_chain("m", echoed) == full


def test_conversations_sharing_a_system_prompt_share_no_unit() -> None:
    one = chat_chain("m", [MSGS[0], {"role": "user", "content": "a"}])
    two = chat_chain("m", [MSGS[0], {"role": "user", "content": "b"}])
    assert not set(one) & set(two)
    assert chat_chain("m", [MSGS[0]]) == ()
    other_head = chat_chain("m", [{"role": "system", "content": "x"}, MSGS[1]])
    assert other_head != chat_chain("m", MSGS[:2])


def test_chains_are_scoped_by_model_salt_and_tools() -> None:
    base = chat_chain("m", MSGS)
    assert chat_chain("m2", MSGS)[0] != base[0]
    assert chat_chain("m", MSGS, cache_salt="tenant")[0] != base[0]
    tool = {"type": "function", "function": {"name": "f"}}
    assert chat_chain("m", MSGS, tools=[tool])[0] != base[0]


def test_text_chain_hashes_whole_blocks_only() -> None:
    prompt = "x" * 600
    chain = text_chain("m", prompt, block=256)
    assert len(chain) == 2  # 600 chars: two whole blocks; the partial tail is left out
    assert text_chain("m", prompt + "more text", block=256)[:2] == chain
    assert text_chain("m", list(range(130)), block=256) == text_chain("m", list(range(128)))


def test_match_length_is_the_longest_held_prefix() -> None:
    chain = ("a", "b", "c", "d")
    assert match_length(chain, {"a", "b"}) == 2
    assert match_length(chain, {"c"}) == 3  # a chained hash implies its prefix
    assert match_length(chain, set(), {"d"}) == 4
    assert match_length(chain, {"x"}) == 0
    assert match_length((), {"a"}) == 0


def test_longest_warm_prefix_wins_over_load() -> None:
    chain = ("h1", "h2", "h3")
    views = [
        ReplicaView("r1", in_flight=0, warm=frozenset({"h1"})),
        ReplicaView("r2", in_flight=1, warm=frozenset({"h1", "h2"})),
        ReplicaView("r3", in_flight=0),
    ]
    decision = rank(chain, views)
    assert decision.matched == 2
    # The others follow: a partial match before none.
    assert decision.groups == [["r2"], ["r1"], ["r3"]]


def test_routed_hashes_count_like_reported_ones() -> None:
    views = [ReplicaView("r1"), ReplicaView("r2", routed=frozenset({"h1"}))]
    assert rank(("h1", "h2"), views).groups[0] == ["r2"]


def test_new_conversation_goes_to_the_least_loaded() -> None:
    views = [
        ReplicaView("r1", in_flight=1),
        ReplicaView("r2", in_flight=0),
        ReplicaView("r3", in_flight=0),
    ]
    decision = rank(("new",), views)
    assert decision.matched == 0
    assert decision.groups == [["r2"], ["r3"], ["r1"]]
    # Equal load: the replica holding fewer conversations first (sequential new ones spread).
    spread = [ReplicaView("r1", held=8), ReplicaView("r2", held=3)]
    assert rank(("new",), spread).groups == [["r2"], ["r1"]]


def test_busy_warm_replica_is_passed_over_but_kept_last() -> None:
    chain = ("h1", "h2")
    views = [
        ReplicaView("warm", in_flight=2, warm=frozenset(chain)),  # at busy_requests
        ReplicaView("cold", in_flight=0),
    ]
    decision = rank(chain, views)
    assert decision.groups == [["cold"], ["warm"]]
    assert decision.matched == 0


def test_slow_warm_replica_is_passed_over() -> None:
    chain = ("h1",)
    views = [
        ReplicaView("slow", warm=frozenset(chain), ttft_ms=9000.0),
        ReplicaView("a", ttft_ms=200.0),
        ReplicaView("b", ttft_ms=250.0),
    ]
    assert rank(chain, views).groups == [["a"], ["b"], ["slow"]]
    # Slow needs both: over slow_factor x the median and over the floor.
    quick = [
        ReplicaView("x", warm=frozenset(chain), ttft_ms=900.0),
        ReplicaView("a", ttft_ms=10.0),
        ReplicaView("b", ttft_ms=10.0),
    ]
    assert rank(chain, quick).groups[0] == ["x"]


def test_all_busy_still_routes_warmest_first() -> None:
    chain = ("h1", "h2")
    views = [
        ReplicaView("r1", in_flight=5, warm=frozenset({"h1"})),
        ReplicaView("r2", in_flight=9, warm=frozenset({"h1", "h2"})),
    ]
    assert rank(chain, views).groups == [["r2"], ["r1"]]
    assert rank(chain, []).groups == []


def test_warm_set_is_bounded_and_recent_first() -> None:
    warm = WarmSet(capacity=3)
    warm.add(["a", "b"])
    warm.add(["c", "d"])
    assert warm.recent() == ["d", "c", "b"]
    warm.add(["b"])  # used again: most recent
    assert warm.recent(2) == ["b", "d"]
    assert len(warm) == 3


def test_affinity_table_records_moves_and_forgets_dead_replicas() -> None:
    table = AffinityTable(capacity=4)
    table.record(("h1", "h2"), "r1")
    table.record(("h3",), "r2")
    assert table.warm_of(("h1", "h2", "h9")) == {"r1": {"h1", "h2"}}
    table.record(("h1",), "r2")  # the conversation moved
    assert table.warm_of(("h1",)) == {"r2": {"h1"}}
    table.forget(["r2"])  # r1 died
    assert table.warm_of(("h1", "h2", "h3")) == {"r2": {"h1", "h3"}}
    assert table.count("r2") == 2 and table.count("r1") == 0
    table.record(("a", "b", "c", "d"), "r2")
    assert len(table) == 4  # bounded: the oldest went
    assert table.count("r2") == 4


def test_last_rows_give_a_follow_up_its_previous_turn() -> None:
    rows = LastRows(capacity=2)
    turn1 = chat_chain("m", MSGS[:2])
    rows.remember(turn1, b"k1" * 16)
    rows.remember((), b"ignored" * 4)
    rows.remember(("x",), None)
    assert rows.parent_of(chat_chain("m", MSGS)) == b"k1" * 16
    assert rows.parent_of(chat_chain("m", [MSGS[0], {"role": "user", "content": "no"}])) is None
    rows.remember(("a",), b"a" * 32)
    rows.remember(("b",), b"b" * 32)
    assert rows.parent_of(turn1) is None and len(rows) == 2  # bounded: the oldest went


class LeastLoaded:
    """A policy of a test's own: load only, warm or not."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.seen: list[RouteRequest] = []

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        self.seen.append(request)
        ordered = sorted(views, key=lambda v: (v.in_flight, v.id))
        return Decision([[v.id] for v in ordered], 0)


@pytest.fixture
def least_loaded() -> Iterator[str]:
    register_policy("least_loaded", LeastLoaded)
    try:
        yield "least_loaded"
    finally:
        unregister_policy("least_loaded")


def test_the_prefix_policy_stays_registered_as_the_fallback() -> None:
    assert "prefix" in registered_policies()
    assert Settings(cluster_routing="prefix").cluster_routing == "prefix"
    policy = build_policy(dataclasses.replace(CONFIG, policy="prefix"))
    assert isinstance(policy, PrefixPolicy) and policy.config.busy_requests == 2


def test_an_unknown_policy_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=UNKNOWN):
        build_policy(RoutingConfig(policy="nope"))
    with pytest.raises(ConfigError, match="routing policy names"):
        register_policy("no spaces", LeastLoaded)
    assert "no spaces" not in registered_policies()


def test_a_registered_policy_is_built_by_name_and_ranks(least_loaded: str) -> None:
    policy = build_policy(RoutingConfig(policy=least_loaded, busy_requests=7))
    assert isinstance(policy, LeastLoaded) and policy.config.busy_requests == 7
    chain = ("h1", "h2")
    views = [
        ReplicaView("warm", in_flight=1, warm=frozenset(chain)),
        ReplicaView("cold", in_flight=0),
    ]
    # The prefix policy sends the conversation to its warm replica; this one ignores warmth.
    assert rank(chain, views).groups[0] == ["warm"]
    assert policy.rank(RouteRequest(chain, "m"), views).groups == [["cold"], ["warm"]]
    assert policy.seen == [RouteRequest(chain, "m")]
    unregister_policy(least_loaded)
    with pytest.raises(ConfigError, match="least_loaded"):
        build_policy(RoutingConfig(policy=least_loaded))
