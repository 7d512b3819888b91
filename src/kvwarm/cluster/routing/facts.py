"""What a replica tells routers about its cache: facts, the events that carry them, and the
plain encoding they travel in. Pure: no Ray, no clock, no I/O.

Facts (each an event when it changes):

- ``RowFact``: a row (its key, token count, chunk keys and their lengths) is in one of the
  replica's tiers;
  ``RowGone``: it left that tier, its bytes deleted or (``bytes_kept``) only forgotten by this
  replica (a shared tier's row after a TTL lapse, a copy left by a promotion).
- ``Live``: a slot of the replica holds a conversation's KV (the chain end of the request it
  just finished, its finish row's key, its tokens); ``LiveGone``: that slot was reused.
- ``Link``: a chain end (``chains``) names a row key: the request with that chain saved that
  row when it finished. A fact about content, true wherever the row is.

Where a tier's copy can be restored from (``Scope``), and how fast (``Source``), follow from
the tier's capabilities (``place``): a tier no other process publishes into is the
replica's own (``replica``); one other processes on this host share (a local directory,
/dev/shm) serves every replica on the node (``node``); one that is not on this machine (s3,
redis, a directory all nodes mount) serves every replica (``cluster``).

Invariants: events carry a sequence number that grows by one per event within an *epoch*
(one replica process); a listener that applies them in order from a snapshot of the same
epoch holds what the replica holds. Everything that crosses Ray is plain (tuples, str, bytes,
int), so Serve's controller, which relays routing stats, needs nothing of kvwarm to unpickle
them; ``decode`` refuses anything else with ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

from kvwarm.cache.protocols import TierCapabilities
from kvwarm.cache.types import Namespace

__all__ = [
    "SCOPES",
    "SOURCES",
    "Fact",
    "Link",
    "Live",
    "LiveGone",
    "Report",
    "RowFact",
    "RowGone",
    "Scope",
    "Snapshot",
    "Source",
    "decode",
    "decode_namespace",
    "decode_report",
    "decode_snapshot",
    "encode",
    "encode_namespace",
    "place",
]

Scope = Literal["replica", "node", "cluster"]
Source = Literal["live", "memory", "local", "remote"]
SCOPES: tuple[Scope, ...] = ("replica", "node", "cluster")
SOURCES: tuple[Source, ...] = ("live", "memory", "local", "remote")


def place(caps: TierCapabilities) -> tuple[Scope, Source]:
    """Who can restore from a tier with ``caps``, and how fast (module docstring)."""
    if not caps.local:
        return "cluster", "remote"
    source: Source = "local" if caps.persistent else "memory"
    return ("node" if caps.shared else "replica"), source


@dataclass(frozen=True, slots=True)
class RowFact:
    key: bytes
    tier: str
    scope: Scope
    source: Source
    n_tokens: int
    chunks: tuple[bytes, ...] = ()
    # How many tokens each of the first ``len(lens)`` chunks covers, in order (the chunks
    # past them are a memory's rest: an iSWA window's, no prefix of the prompt).
    lens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RowGone:
    key: bytes
    tier: str
    scope: Scope
    bytes_kept: bool


@dataclass(frozen=True, slots=True)
class Live:
    chain_end: str
    key: bytes | None
    n_tokens: int


@dataclass(frozen=True, slots=True)
class LiveGone:
    chain_end: str


@dataclass(frozen=True, slots=True)
class Link:
    chain_end: str
    key: bytes


Fact = RowFact | RowGone | Live | LiveGone | Link


@dataclass(frozen=True, slots=True)
class Report:
    """The tail of a replica's event log, as one routing-stats report carries it: the events
    numbered ``seq - len(events) + 1 .. seq`` (none if nothing happened lately)."""

    epoch: str
    seq: int
    slots: int
    events: tuple[tuple[int, Fact], ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a replica holds as of event ``seq``: what its events since the epoch began
    add up to."""

    epoch: str
    seq: int
    slots: int
    rows: tuple[RowFact, ...]
    live: tuple[Live, ...]
    links: tuple[Link, ...]


# ---------------------------------------------------------------------- plain encoding


def encode(fact: Fact) -> tuple[object, ...]:
    if isinstance(fact, RowFact):
        return (
            "row", fact.key, fact.tier, fact.scope, fact.source, fact.n_tokens, fact.chunks,
            fact.lens,
        )  # fmt: skip
    if isinstance(fact, RowGone):
        return ("gone", fact.key, fact.tier, fact.scope, fact.bytes_kept)
    if isinstance(fact, Live):
        return ("live", fact.chain_end, fact.key, fact.n_tokens)
    if isinstance(fact, LiveGone):
        return ("unlive", fact.chain_end)
    return ("link", fact.chain_end, fact.key)


def encode_namespace(ns: Namespace) -> tuple[bytes, int, bytes]:
    """A model's cache namespace as a replica reports it (plain values)."""
    return (ns.fingerprint, ns.quant, ns.ctx_hash)


def decode_namespace(raw: object) -> Namespace | None:
    """The namespace ``encode_namespace`` made; None for anything else (not reported yet,
    or unreadable: the request is then routed without its chunks)."""
    if not isinstance(raw, tuple | list) or len(raw) != 3:
        return None
    fingerprint, quant, ctx_hash = raw
    if not (isinstance(fingerprint, bytes) and len(fingerprint) == 32):
        return None
    if not (isinstance(ctx_hash, bytes) and len(ctx_hash) == 32):
        return None
    if not isinstance(quant, int) or isinstance(quant, bool) or not 0 <= quant <= 255:
        return None
    return Namespace(fingerprint, quant, ctx_hash)


def _bytes(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError(f"expected bytes, got {type(value).__name__}")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected str, got {type(value).__name__}")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a count, got {value!r}")
    return value


def _scope(value: object) -> Scope:
    if value not in SCOPES:
        raise ValueError(f"unknown scope {value!r}")
    return value


def _source(value: object) -> Source:
    if value not in SOURCES:
        raise ValueError(f"unknown source {value!r}")
    return value


def decode(item: object) -> Fact:
    """The fact ``encode`` made; ``ValueError`` for anything else."""
    if not isinstance(item, tuple | list) or not item:
        raise ValueError(f"not an encoded fact: {item!r:.80}")
    tag, *rest = item
    try:
        if tag == "row":
            key, tier, scope, source, n, chunks, lens = rest
            if not isinstance(chunks, tuple | list) or not isinstance(lens, tuple | list):
                raise ValueError("chunks and lens must be sequences")
            if len(lens) > len(chunks) or not all(_int(n) > 0 for n in lens):
                raise ValueError("lens must be positive, one per leading chunk")
            return RowFact(
                _bytes(key),
                _str(tier),
                _scope(scope),
                _source(source),
                _int(n),
                tuple(_bytes(c) for c in chunks),
                tuple(lens),
            )
        if tag == "gone":
            key, tier, scope, kept = rest
            return RowGone(_bytes(key), _str(tier), _scope(scope), bool(kept))
        if tag == "live":
            end, key, n = rest
            return Live(_str(end), None if key is None else _bytes(key), _int(n))
        if tag == "unlive":
            (end,) = rest
            return LiveGone(_str(end))
        if tag == "link":
            end, key = rest
            return Link(_str(end), _bytes(key))
    except (TypeError, ValueError) as exc:  # wrong arity unpacks as ValueError
        raise ValueError(f"bad {tag!r} fact: {exc}") from exc
    raise ValueError(f"unknown fact {tag!r}")


def _field(raw: Mapping[str, object], name: str) -> object:
    if name not in raw:
        raise ValueError(f"missing {name!r}")
    return raw[name]


def _items(raw: Mapping[str, object], name: str) -> Sequence[object]:
    value = raw.get(name, ())
    if not isinstance(value, tuple | list):
        raise ValueError(f"{name!r} must be a sequence")
    return value


def decode_report(raw: object) -> Report:
    """A report as ``EventLog.report`` encodes it (``cluster/eventlog.py``)."""
    if not isinstance(raw, Mapping):
        raise ValueError("a report is a mapping")
    events: list[tuple[int, Fact]] = []
    for item in _items(raw, "events"):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError("an event is (seq, fact)")
        events.append((_int(item[0]), decode(item[1])))
    return Report(
        _str(_field(raw, "epoch")),
        _int(_field(raw, "seq")),
        _int(raw.get("slots", 1)),
        tuple(events),
    )


def decode_snapshot(raw: object) -> Snapshot:
    if not isinstance(raw, Mapping):
        raise ValueError("a snapshot is a mapping")

    def facts(name: str, kind: type[RowFact] | type[Live] | type[Link]) -> list[Fact]:
        out = [decode(item) for item in _items(raw, name)]
        if not all(isinstance(f, kind) for f in out):
            raise ValueError(f"{name!r} holds another kind of fact")
        return out

    return Snapshot(
        _str(_field(raw, "epoch")),
        _int(_field(raw, "seq")),
        _int(raw.get("slots", 1)),
        tuple(cast(list[RowFact], facts("rows", RowFact))),
        tuple(cast(list[Live], facts("live", Live))),
        tuple(cast(list[Link], facts("links", Link))),
    )
