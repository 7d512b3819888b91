"""The ``events`` routing policy (``routing/events.py``): replicas ranked by the tokens of a
request each could serve, weighed by source, against their load; without Ray."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvwarm.cluster.routing import (
    DEFAULT_POLICY,
    Decision,
    EventsPolicy,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    build_policy,
    registered_policies,
)
from kvwarm.settings import Settings

CONFIG = RoutingConfig(busy_requests=4, slow_factor=3.0, slow_floor_ms=1000.0)
CHAIN = ("h1", "h2", "h3")


def view(
    rid: str,
    reach: Mapping[str, int] | None = None,
    *,
    in_flight: int = 0,
    slots: int = 1,
    held: int = 0,
    ttft_ms: float | None = None,
    routed: frozenset[str] = frozenset(),
) -> ReplicaView:
    return ReplicaView(
        rid,
        in_flight=in_flight,
        reach=dict(reach or {}),
        slots=slots,
        held=held,
        ttft_ms=ttft_ms,
        routed=routed,
    )


def rank(views: Sequence[ReplicaView], chain: tuple[str, ...] = CHAIN) -> Decision:
    return EventsPolicy(CONFIG).rank(RouteRequest(chain), views)


def order(decision: Decision) -> list[str]:
    return [g[0] for g in decision.groups]


def test_events_is_the_default_and_prefix_stays_registered() -> None:
    assert DEFAULT_POLICY == "events" == Settings().cluster_routing
    assert {"events", "prefix"} <= set(registered_policies())
    assert isinstance(build_policy(RoutingConfig()), EventsPolicy)


def test_the_replica_that_could_serve_more_wins_by_the_documented_score() -> None:
    # a: 600 tokens live, one request in flight on its one slot: 600 - 128 = 472.
    # b: 500 tokens in its RAM tier, idle: 0.95 x 500 = 475.
    decision = rank([view("a", {"live": 600}, in_flight=1), view("b", {"memory": 500})])
    assert order(decision) == ["b", "a"]
    assert decision.matched == 475
    # With two slots a's load halves: 600 - 64 = 536 beats 475.
    decision = rank([view("a", {"live": 600}, in_flight=1, slots=2), view("b", {"memory": 500})])
    assert order(decision) == ["a", "b"]


def test_sources_rank_by_what_a_restore_costs() -> None:
    same = 400
    views = [
        view("remote", {"remote": same}),
        view("local", {"local": same}),
        view("memory", {"memory": same}),
        view("live", {"live": same}),
        view("none"),
    ]
    assert order(rank(views)) == ["live", "memory", "local", "remote", "none"]
    # The best source of a replica counts, not their sum.
    assert (
        EventsPolicy(CONFIG).served(RouteRequest(CHAIN), view("x", {"live": 100, "remote": 1000}))
        == 600.0
    )


def test_a_long_prefix_in_the_shared_tier_beats_a_short_live_one() -> None:
    # The dead replica's conversation: 2,000 tokens any replica restores from s3 (x0.6 =
    # 1,200) against a slot holding the shared system prompt only (300 live).
    decision = rank([view("a", {"live": 300}), view("b", {"remote": 2000})])
    assert order(decision)[0] == "b"


def test_load_outweighs_a_small_prefix() -> None:
    # 100 cached tokens do not make up for three requests in flight (100 - 384 < 0).
    decision = rank([view("a", {"live": 100}, in_flight=3), view("b")])
    assert order(decision) == ["b", "a"]


def test_new_conversations_spread_by_load_then_by_what_replicas_hold() -> None:
    assert order(rank([view("a", in_flight=1), view("b")], ())) == ["b", "a"]
    assert order(rank([view("a", held=9), view("b", held=2)], ())) == ["b", "a"]
    assert rank([view("a"), view("b")], ()).matched == 0


def test_busy_and_slow_replicas_rank_last_when_another_could_serve_some() -> None:
    busy = view("busy", {"live": 5000}, in_flight=4)
    slow = view("slow", {"live": 5000}, ttft_ms=9000.0)
    fine = [view("x", {"remote": 800}, ttft_ms=100.0), view("y", ttft_ms=120.0)]
    assert order(rank([busy, slow, *fine])) == ["x", "y", "busy", "slow"]
    # All busy: the warmest first, nobody dropped.
    everyone = [view("a", {"live": 10}, in_flight=5), view("b", {"live": 900}, in_flight=5)]
    assert order(rank(everyone)) == ["b", "a"]


def test_a_busy_replica_that_alone_holds_the_conversation_keeps_it_up_to_twice_busy() -> None:
    # Nobody else could serve any of it: moving means prefilling it all, so the score decides
    # (5000 - 128 x 4 beats an idle cold replica's 0) ...
    home = view("home", {"live": 5000}, in_flight=4)
    assert order(rank([home, view("cold")])) == ["home", "cold"]
    # ... until it holds twice busy_requests: then it is passed over whatever it holds.
    jammed = view("home", {"live": 5000}, in_flight=8)
    assert order(rank([jammed, view("cold")])) == ["cold", "home"]
    # A slow one is passed over regardless.
    stalled = view("home", {"live": 5000}, ttft_ms=9000.0)
    others = [view("a", ttft_ms=100.0), view("b", ttft_ms=110.0)]
    assert order(rank([stalled, *others]))[-1] == "home"


def test_a_chain_this_router_sent_counts_until_the_replica_reports_it() -> None:
    # Two choices of one request (n=2): the first is still running on a, nothing reported.
    routed = view("a", routed=frozenset({"h1"}), in_flight=1, slots=4)
    decision = rank([routed, view("b")])
    assert order(decision) == ["a", "b"]  # 64 x 1 unit - 128 x 1/4 = 32 > 0
    assert decision.matched == 64


def test_no_replicas_no_groups() -> None:
    assert rank([]) == Decision([], 0)


def test_the_replica_a_conversation_was_sent_to_outranks_shared_prompt_chunks_elsewhere() -> None:
    # Issue 40 (seen in the live two-node test): b's report shows the system prompt's 250
    # tokens in RAM (another conversation's); a's report of this conversation is still on its
    # way, but the router sent its 300-token previous turn there. Counted as chain units
    # (2 x 64 = 128) it lost to b's 237.5 and the conversation moved off its live slot.
    a = ReplicaView("a", routed=frozenset({"h1", "h2"}), routed_tokens=300)
    b = view("b", {"memory": 250})
    assert order(rank([b, a])) == ["a", "b"]
    # Without the routed prompt's tokens (the ingress could not tokenize it) units count.
    units_only = ReplicaView("a", routed=frozenset({"h1", "h2"}))
    assert order(rank([b, units_only])) == ["b", "a"]
