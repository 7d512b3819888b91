"""The cluster's index of cache events (``routing/index.py``) fed by replicas' event logs
(``cluster/eventlog.py``), without Ray: what each replica could serve of a request, which
stores a copy lives in, and convergence when reports are lost or replayed, when the router
restarts and when a replica restarts."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TtlClass
from kvwarm.cluster.eventlog import EventLog
from kvwarm.cluster.routing import index as index_module
from kvwarm.cluster.routing.facts import Scope, Source, decode_snapshot
from kvwarm.cluster.routing.index import ClusterIndex

NS = Namespace(b"f" * 32, 1, b"c" * 32)
PLACES: Mapping[str, tuple[Scope, Source]] = {
    "ram": ("replica", "memory"),
    "disk": ("node", "local"),
    "s3": ("cluster", "remote"),
}


def row(name: str, tier: str = "ram", n_tokens: int = 100, n_chunks: int = 2) -> StoredRow:
    key = name.encode().ljust(32, b".")
    info = RowInfo(
        key, tier, 10, n_tokens, 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT, False, NS
    )
    chunks = tuple(f"{name}/{i}".encode().ljust(32, b"-") for i in range(n_chunks))
    return StoredRow(info, tuple(range(n_tokens)), None, chunks, (n_tokens // 2,) * n_chunks)


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def feed(index: ClusterIndex, replica: str, node: str, log: EventLog) -> bool:
    return index.observe(replica, node, {"events": log.report(), "in_flight": 0})


def expected(log: EventLog) -> tuple[frozenset[tuple[bytes, str]], frozenset[str], int]:
    snap = decode_snapshot(log.snapshot())
    return (
        frozenset((r.key, r.tier) for r in snap.rows),
        frozenset(live.chain_end for live in snap.live),
        snap.seq,
    )


def test_a_report_applies_rows_chunks_links_and_live_slots() -> None:
    log = EventLog(PLACES, slots=2)
    index = ClusterIndex()
    log.row_stored(row("k1"))
    log.served(("h1",), key("k1"), 100)
    assert feed(index, "a", "n1", log) is False
    assert index.facts_of("a") == expected(log)
    assert index.sizes()["chunks"] == 2
    # A follow-up's chain runs through h1: the live slot and the linked row in RAM.
    assert index.reach(("h1", "h2", "h3"), None, {"a": "n1", "b": "n1"}) == {
        "a": {"live": 100, "memory": 100}
    }
    # Two more conversations finish on a two-slot replica: h1's slot is reused.
    log.served(("x1",), None, 40)
    log.served(("y1",), None, 50)
    log.row_dropped(row("k1"), bytes_kept=False)
    feed(index, "a", "n1", log)
    assert index.facts_of("a") == expected(log)
    assert index.reach(("h1", "h2"), None, {"a": "n1"}) == {}
    assert index.sizes()["chunks"] == 0


def test_node_and_cluster_copies_serve_the_replicas_that_can_read_them() -> None:
    logs = {r: EventLog(PLACES) for r in "abc"}
    nodes = {"a": "n1", "b": "n1", "c": "n2"}
    index = ClusterIndex()
    logs["a"].row_stored(row("own"))
    logs["a"].row_stored(row("disk", "disk", 300))
    logs["a"].row_stored(row("s3", "s3", 500))
    for r, log in logs.items():
        feed(index, r, nodes[r], log)
    reach = {k: index.reach((), key(k), nodes) for k in ("own", "disk", "s3")}
    assert reach["own"] == {"a": {"memory": 100}}
    assert reach["disk"] == {"a": {"local": 300}, "b": {"local": 300}}  # node n1's directory
    assert reach["s3"] == {r: {"remote": 500} for r in "abc"}
    # a dies: its own RAM goes with it; the node's directory and the bucket keep their rows.
    alive = {"b": "n1", "c": "n2"}
    index.retain(alive)
    assert index.reach((), key("own"), alive) == {}
    assert index.reach((), key("disk"), alive) == {"b": {"local": 300}}
    assert index.reach((), key("s3"), alive) == {"b": {"remote": 500}, "c": {"remote": 500}}
    # c adopts the bucket's row, then evicts it: the object is deleted for everyone.
    logs["c"].row_stored(row("s3", "s3", 500))
    logs["c"].row_dropped(row("s3", "s3", 500), bytes_kept=False)
    feed(index, "c", "n2", logs["c"])
    assert index.reach((), key("s3"), alive) == {}
    # b forgets the node's row on a TTL lapse: it is only forgotten, its bytes stay.
    logs["b"].row_stored(row("disk", "disk", 300))
    logs["b"].row_dropped(row("disk", "disk", 300), bytes_kept=True)
    feed(index, "b", "n1", logs["b"])
    assert index.reach((), key("disk"), alive) == {"b": {"local": 300}}


def test_served_notes_count_before_the_replicas_events_arrive() -> None:
    index = ClusterIndex()
    index.retain({"a": "n1", "b": "n2"})
    index.note_served("b", ("h1",), key("k"), 80)
    assert index.reach(("h1", "h2"), None, {"a": "n1", "b": "n2"}) == {"b": {"live": 80}}
    log = EventLog(PLACES)
    log.row_stored(row("k", n_tokens=80))
    log.served(("h1",), key("k"), 80)
    feed(index, "b", "n2", log)  # the same facts again, from the replica: no double count
    assert index.reach(("h1",), None, {"b": "n2"}) == {"b": {"live": 80, "memory": 80}}
    assert index.held("b") == 2


def test_a_served_note_arriving_after_its_replica_died_does_not_revive_it() -> None:
    # The ingress reads a reply's end after Ray told the router its replica died (a kill just
    # as the reply ended): the note must not list the dead replica as running again, with a
    # live slot, until the next change of replicas. Found by review.
    index = ClusterIndex()
    index.retain({"a": "n1", "b": "n1"})
    index.died("b")
    index.note_served("b", ("h1",), key("k"), 80)
    health = {r["id"]: r["health"] for r in index.describe()["replicas"]}  # type: ignore[index, union-attr]
    assert health == {"a": "running", "b": "dead"}
    assert index.held("b") == 0
    # Its row is a fact wherever it is: a replica reading the shared copy finds it by the link.
    log = EventLog(PLACES)
    log.row_stored(row("k", "disk", 80))
    feed(index, "a", "n1", log)
    assert index.reach(("h1",), None, {"a": "n1"}) == {"a": {"local": 80}}


def at(index: ClusterIndex, replica: str, log: EventLog, now: float) -> None:
    index.observe(replica, "n1", {"events": log.report()}, now)


def test_a_conversation_is_let_go_once_its_slot_and_its_row_are_gone() -> None:
    # ``let_go``: of the conversations a router sent to a replica, those the replica
    # demonstrably holds nothing of (``AffinityRouter._claims`` ends its own record there).
    index = ClusterIndex()
    log = EventLog(PLACES, slots=1)
    ends = {"h1", "h2", "h3", "never"}
    log.row_stored(row("k1"))  # saved before the reply's end was reported
    log.served(("h1",), key("k1"), 100)
    at(index, "a", log, 0.0)
    assert index.let_go("a", ends, 0.0) == set()  # live
    log.served(("h2",), key("k2"), 100)  # h1's slot reused; k2's save still on its way
    at(index, "a", log, 1.0)
    assert index.let_go("a", ends, 1.0) == set()  # k1 in RAM; k2 live
    log.served(("h3",), None, 100)  # h2's slot reused too; h3 had no finish save
    log.row_stored(row("k2"))  # k2's row, reported after its slot's reuse
    log.row_dropped(row("k1"), bytes_kept=True)  # k1 moves to disk, as the cache says it:
    log.row_stored(row("k1", "disk"))  # gone from RAM, then stored there
    at(index, "a", log, 2.0)
    assert index.let_go("a", ends, 2.0) == set()  # every row still held somewhere
    log.row_dropped(row("k1", "disk"), bytes_kept=False)
    log.row_dropped(row("k2"), bytes_kept=False)
    log.served(("h4",), None, 100)  # h3's slot reused: it never had a row
    at(index, "a", log, 3.0)
    assert index.let_go("a", ends, 3.0) == {"h1", "h2", "h3"}  # "never": not served there
    assert index.let_go("b", ends, 3.0) == set()  # nor anything on a replica not known
    log.served(("h1",), key("k1"), 100)  # h1 sent and served there again: live
    at(index, "a", log, 4.0)
    assert index.let_go("a", ends, 4.0) == {"h2", "h3"}


def test_a_finish_row_never_reported_is_let_go_after_a_bound() -> None:
    # A save dropped (a full writer queue) or failed never reports its row: the slot's
    # reuse alone does not let go of the conversation until ``ROW_REPORT_S`` after the
    # replica reported its slot (its row may be on its way), then it does.
    index = ClusterIndex()
    log = EventLog(PLACES, slots=1)
    log.served(("h1",), key("k1"), 100)
    at(index, "a", log, 100.0)
    log.served(("h2",), None, 100)
    at(index, "a", log, 101.0)
    bound = index_module.ROW_REPORT_S
    assert index.let_go("a", {"h1"}, 100.0 + bound - 1) == set()
    assert index.let_go("a", {"h1"}, 100.0 + bound) == {"h1"}
    # Reports without a time (a caller passing none): the bound runs from the first ask.
    untimed, log = ClusterIndex(), EventLog(PLACES, slots=1)
    log.served(("h1",), key("k1"), 100)
    log.served(("h2",), None, 100)
    untimed.observe("a", "n1", {"events": log.report()})
    assert untimed.let_go("a", {"h1"}, 500.0) == set()
    assert untimed.let_go("a", {"h1"}, 500.0 + bound) == {"h1"}


def test_the_conversations_let_go_follows_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "SERVED_KEPT", 3)
    index = ClusterIndex()
    log = EventLog(PLACES, slots=1, capacity=1 << 16, max_events=1 << 16)
    for i in range(50):
        log.served((f"h{i}",), key(f"k{i}"), 10)
    log.row_stored(row("k49"))
    at(index, "a", log, 0.0)
    state = index._replicas["a"]
    assert list(state.served) == ["h47", "h48", "h49"]
    assert set(state.served_rows) == {key("k47"), key("k48"), key("k49")}
    # One forgotten: not known to be gone, so never let go (the router's record stays).
    assert index.let_go("a", {"h0", "h47"}, 1e9) == {"h47"}


def test_a_snapshot_keeps_the_shared_copies_no_replica_vouches_for() -> None:
    # A snapshot replaced what its replica vouched for by dropping all of it first: its own
    # shared copies passed through the bounded set of unvouched ones and pushed out copies
    # a dead replica left, whose bytes are still there to restore. Found by review.
    index = ClusterIndex(unvouched=2)
    index.retain({"d": "n1", "a": "n1"})
    dead = EventLog(PLACES, epoch="d")
    for name in ("k1", "k2"):
        dead.row_stored(row(name, "disk", 100))
    feed(index, "d", "n1", dead)
    log = EventLog(PLACES, epoch="a")
    log.row_stored(row("k3", "disk", 100))
    feed(index, "a", "n1", log)
    index.died("d")  # k1, k2: unvouched now, their bytes in n1's directory
    assert index.load_snapshot("a", log.snapshot())
    alive = {"a": "n1"}
    for name in ("k1", "k2", "k3"):
        assert index.reach((), key(name), alive) == {"a": {"local": 100}}, name
    assert index.sizes()["unvouched"] == 2


def test_a_gap_wants_a_snapshot_and_a_replay_changes_nothing() -> None:
    log = EventLog(PLACES, window=1)
    index = ClusterIndex()
    log.row_stored(row("k1"))
    first = log.report()
    assert index.observe("a", "n1", {"events": first}) is False
    log.row_stored(row("k2"))
    log.report()  # lost on the way
    log.row_stored(row("k3"))
    assert feed(index, "a", "n1", log) is True  # k2's event is missing: nothing applied
    assert index.wanted() == ["a"]
    assert index.facts_of("a") == (frozenset({(key("k1"), "ram")}), frozenset(), 1)
    assert index.load_snapshot("a", log.snapshot())
    assert index.wanted() == [] and index.facts_of("a") == expected(log)
    assert index.observe("a", "n1", {"events": first}) is False  # replayed: old news
    assert index.facts_of("a") == expected(log)


def test_unreadable_reports_and_stale_snapshots_are_refused() -> None:
    index = ClusterIndex()
    assert index.observe("a", "n1", {"events": {"epoch": "e", "seq": 1, "events": [(1, ("?",))]}})
    assert index.wanted() == ["a"]
    assert not index.load_snapshot("a", {"epoch": "e"})  # no seq
    old = EventLog(PLACES, epoch="old")
    new = EventLog(PLACES, epoch="new")
    new.row_stored(row("k"))
    feed(index, "a", "n1", new)
    assert not index.load_snapshot("a", old.snapshot())  # another process's state
    assert index.facts_of("a") == expected(new)


class Sim:
    """Replicas doing random cache work; their reports reach the router late, twice or not
    at all; the router asks for snapshots when it sees a gap, and they arrive late too."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.nodes = {"a": "n1", "b": "n1", "c": "n2"}
        self.logs = {r: EventLog(PLACES, slots=2, window=2) for r in self.nodes}
        self.held: dict[str, dict[bytes, StoredRow]] = {r: {} for r in self.nodes}
        self.sent: list[tuple[str, dict[str, object]]] = []
        self.pending: list[tuple[str, dict[str, object]]] = []  # snapshots on their way
        self.index = ClusterIndex()
        self.n = 0

    def work(self, replica: str) -> None:
        log, held = self.logs[replica], self.held[replica]
        op = self.rng.random()
        if op < 0.45 or not held:
            self.n += 1
            r = row(
                f"{replica}{self.n}", self.rng.choice(list(PLACES)), self.rng.randrange(50, 900)
            )
            held[r.info.key] = r
            log.row_stored(r)
        elif op < 0.75:
            r = held.pop(self.rng.choice(list(held)))
            log.row_dropped(r, bytes_kept=self.rng.random() < 0.3)
        else:
            end = f"h{self.rng.randrange(30)}"
            log.served((end,), self.rng.choice([*held, None]), self.rng.randrange(10, 500))

    def deliver(self) -> None:
        for replica in self.nodes:
            report = {"events": self.logs[replica].report()}
            self.sent.append((replica, report))
            if self.rng.random() < 0.5:  # lost
                continue
            self.observe(replica, report)
        if self.sent and self.rng.random() < 0.3:  # an old one, again
            self.observe(*self.rng.choice(self.sent))
        while self.pending and self.rng.random() < 0.6:
            self.index.load_snapshot(*self.pending.pop(0))

    def observe(self, replica: str, report: dict[str, object]) -> None:
        if self.index.observe(replica, self.nodes[replica], report):
            # Taken now, arriving later (after more events, maybe after another restart).
            self.pending.append((replica, self.logs[replica].snapshot()))

    def settle(self) -> None:
        """No more loss: every replica's next report, and snapshots for every gap."""
        self.pending.clear()
        for _ in range(3):
            for replica in self.nodes:
                self.observe(replica, {"events": self.logs[replica].report()})
            for replica in self.index.wanted():
                assert self.index.load_snapshot(replica, self.logs[replica].snapshot())
        for replica, log in self.logs.items():
            assert self.index.facts_of(replica) == expected(log), replica
        assert self.index.wanted() == []


@pytest.mark.parametrize("seed", range(6))
def test_lost_and_replayed_events_router_and_replica_restarts_converge(seed: int) -> None:
    sim = Sim(seed)
    for step in range(120):
        for replica in sim.nodes:
            for _ in range(sim.rng.randrange(4)):
                sim.work(replica)
        sim.deliver()
        if step == 40:
            sim.index = ClusterIndex()  # the router restarts: it knows nothing
            sim.pending.clear()
        if step == 70:  # replica c restarts: a new process, a new epoch, an empty RAM tier
            sim.logs["c"] = EventLog(PLACES, slots=2, window=2)
            sim.held["c"] = {}
    sim.settle()
    assert all(r["resyncs"] > 0 for r in sim.index.describe()["replicas"])  # type: ignore[index,union-attr,attr-defined]
    # What the index says each replica could serve equals what their logs add up to.
    fresh = ClusterIndex()
    for replica, log in sim.logs.items():
        fresh.observe(replica, sim.nodes[replica], {})
        fresh.load_snapshot(replica, log.snapshot())
    # Live slots match exactly (links are bounded hints, order-dependent: not compared).
    for i in range(30):
        got = sim.index.reach((f"h{i}",), None, sim.nodes)
        want = fresh.reach((f"h{i}",), None, sim.nodes)
        for replica in sim.nodes:
            assert got.get(replica, {}).get("live") == want.get(replica, {}).get("live")
    # Rows: replicas' own RAM matches exactly; shared stores may hold more: copies whose
    # bytes were only forgotten stay readable (bounded), and a fresh index never saw them.
    for k in [k for held in sim.held.values() for k in held]:
        got = sim.index.reach((), k, sim.nodes)
        want = fresh.reach((), k, sim.nodes)
        for replica in sim.nodes:
            g, w = got.get(replica, {}), want.get(replica, {})
            for source in ("live", "memory"):
                assert g.get(source) == w.get(source), (k, replica)
            for source in ("local", "remote"):
                assert g.get(source, 0) >= w.get(source, 0), (k, replica)


# ------------------------------------------------------------------ a prompt's chunk keys

SYSTEM_TOKENS = tuple(range(1000, 1040))  # a system prompt of 40 tokens


def chunked(name: str, tokens: tuple[int, ...], lens: tuple[int, ...], **kw: int) -> StoredRow:
    """A row whose chunk keys are the cache's own for ``tokens`` cut at ``lens``."""
    from kvwarm.cache.formats.chunkfmt import chunk_keys

    info = RowInfo(
        key(name), "ram", 10, len(tokens), 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT,
        False, NS,
    )  # fmt: skip
    return StoredRow(info, tokens, None, chunk_keys(NS, tokens, lens, **kw), lens)


def test_a_prompt_reaches_the_replica_holding_its_leading_chunks() -> None:
    log_a, log_b = EventLog(PLACES, epoch="a"), EventLog(PLACES, epoch="b")
    index = ClusterIndex()
    # Conversation 1 on a: the system prompt, then its own turn; cut where the system
    # prompt ends (the second conversation over it made that cut) and every 32 tokens.
    conv1 = SYSTEM_TOKENS + tuple(range(60))
    log_a.row_stored(chunked("c1", conv1, (40, 32, 28)))
    feed(index, "a", "n1", log_a)
    feed(index, "b", "n1", log_b)
    running = {"a": "n1", "b": "n1"}
    # A new conversation over the same system prompt: no chain, no parent row links it to
    # anything; its tokens do: the 40 tokens of the system prompt's chunk are on a.
    conv2 = SYSTEM_TOKENS + tuple(range(500, 530))
    assert index.reach(("new",), None, running, tokens=conv2, namespace=NS) == {"a": {"memory": 40}}
    # Conversation 1's follow-up: every chunk of its row, 100 tokens.
    follow = conv1 + tuple(range(900, 920))
    assert index.reach((), None, running, tokens=follow, namespace=NS) == {"a": {"memory": 100}}
    # Keys are the namespace's: another model's (or salt's) prompt reaches nothing.
    other = Namespace(b"g" * 32, 1, b"c" * 32)
    assert index.reach((), None, running, tokens=follow, namespace=other) == {}
    # Without tokens the index knows only rows and chains (as before).
    assert index.reach(("new",), None, running) == {}
    # The row's bytes go: its chunks and their steps leave the index.
    log_a.row_dropped(chunked("c1", conv1, (40, 32, 28)), bytes_kept=False)
    feed(index, "a", "n1", log_a)
    assert index.reach((), None, running, tokens=follow, namespace=NS) == {}
    assert index.sizes()["chunks"] == 0 and index.sizes()["chunk_steps"] == 0


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_a_prompt_of_ids_no_vocabulary_has_reaches_by_its_chain_alone(bad: int) -> None:
    """A text completion's prompt may be token ids, passed to the router as they came (the
    replica refuses ids its vocabulary lacks, as a 400). Encoding one outside 0..2^32-1 for
    the chunk walk raised ValueError in ``reach``, so in the router (found by review): Ray's
    routing task died and the request waited, unrouted, until its deadline."""
    log = EventLog(PLACES, epoch="a")
    index = ClusterIndex()
    log.row_stored(chunked("c1", SYSTEM_TOKENS, (40,)))
    log.served(("conv",), key("c1"), 40)
    feed(index, "a", "n1", log)
    prompt = (*SYSTEM_TOKENS, bad)
    reach = index.reach(("conv",), None, {"a": "n1"}, tokens=prompt, namespace=NS)
    assert reach == {"a": {"live": 40, "memory": 40}}  # the chain's slot and row: no chunks


def test_chunks_past_a_rows_canonical_bits_and_on_a_node_tier_are_found() -> None:
    log = EventLog(PLACES, epoch="a")
    index = ClusterIndex()
    conv = SYSTEM_TOKENS + tuple(range(90))  # 130 tokens: a reply decoded past 64 of them
    stored = chunked("c1", conv, (40, 32, 32, 26), plain_to=64)  # salted from the third
    disk = StoredRow(
        RowInfo(
            key("c1"), "disk", 10, len(conv), 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT,
            False, NS,
        ),
        conv, None, stored.chunks, stored.chunk_lens,
    )  # fmt: skip
    log.row_stored(disk)
    feed(index, "a", "n1", log)
    running = {"a": "n1", "b": "n1", "c": "n2"}
    prompt = (*conv, 7, 8, 9)
    # The node's directory serves both replicas of n1, all 130 tokens; c is on another node.
    assert index.reach((), None, running, tokens=prompt, namespace=NS) == {
        "a": {"local": 130},
        "b": {"local": 130},
    }
    # A prompt that differs inside the third chunk gets the first two.
    edited = (*conv[:80], 1, *conv[81:])
    assert index.reach((), None, running, tokens=edited, namespace=NS) == {
        "a": {"local": 72},
        "b": {"local": 72},
    }


def test_a_large_snapshot_lets_readers_in_between_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by review: a snapshot load held the index lock throughout (~0.33 s at 20k rows x
    # 16 chunks), and the ingress's served notes take it on its event loop: all HTTP stalled
    # during a large resync. Now the lock is free between batches, and what a reader sees
    # then is facts the replica held before or holds now, never one from neither.
    monkeypatch.setattr(index_module, "LOAD_BATCH", 8, raising=False)
    log = EventLog(PLACES, epoch="e", window=1, slots=4)
    index = ClusterIndex()
    index.retain({"a": "n1", "b": "n1"})
    for i in range(4):
        log.row_stored(row(f"old{i}"))
    feed(index, "a", "n1", log)
    for i in range(4):
        log.row_dropped(row(f"old{i}"), bytes_kept=False)
    for i in range(40):
        log.row_stored(row(f"new{i}", n_chunks=3))
        log.served((f"h{i}",), key(f"new{i}"), 100)
    log.report()  # lost: the router sees a gap and fetches the snapshot
    old = index.facts_of("a")
    assert old is not None
    new = expected(log)
    seen: list[int] = []

    def between() -> None:  # on the loading thread, between two batches
        assert index._lock.acquire(blocking=False), "the lock is held between batches"
        index._lock.release()
        facts = index.facts_of("a")
        assert facts is not None and facts[0] <= old[0] | new[0]
        assert facts[2] == old[2]  # its sequence number changes last
        if len(seen) == 2:
            index.note_served("a", ("noted",), key("new0"), 90)  # the ingress, meanwhile
            facts = index.facts_of("a")
            # A report of the same epoch waits for the snapshot (its window repeats it).
            assert index.observe("a", "n1", {"events": log.report()}) is False
            assert index.facts_of("a") == facts
            assert facts is not None
        seen.append(len(facts[0]))

    monkeypatch.setattr(index_module, "_let_others_in", between, raising=False)
    assert index.load_snapshot("a", log.snapshot())
    assert len(seen) > 3 and seen != sorted(seen, reverse=True)  # batches, rows growing
    rows, live, seq = index.facts_of("a")  # type: ignore[misc]
    assert (rows, seq) == (new[0], new[2])
    assert "noted" in live  # the note made while it loaded is kept, as the newest slot
    assert index.wanted() == []


def test_a_snapshot_overtaken_while_it_loads_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_module, "LOAD_BATCH", 4, raising=False)
    for overtaken_by in ("death", "restart"):
        index = ClusterIndex()
        index.retain({"a": "n1"})
        log = EventLog(PLACES, epoch="e")
        for i in range(20):
            log.row_stored(row(f"r{i}"))
        calls: list[None] = []

        def between(
            overtaken_by: str = overtaken_by, index: ClusterIndex = index, calls: list[None] = calls
        ) -> None:
            if not calls:
                if overtaken_by == "death":
                    index.retain({})
                else:
                    fresh = EventLog(PLACES, epoch="e2")
                    fresh.row_stored(row("fresh"))
                    feed(index, "a", "n1", fresh)
            calls.append(None)

        monkeypatch.setattr(index_module, "_let_others_in", between, raising=False)
        assert not index.load_snapshot("a", log.snapshot()), overtaken_by
        assert len(calls) == 1  # it stopped at once
        if overtaken_by == "death":
            assert index.facts_of("a") is None and index.sizes()["rows"] == 0
        else:
            assert index.facts_of("a") == (frozenset({(key("fresh"), "ram")}), frozenset(), 1)
