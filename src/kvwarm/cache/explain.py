"""Why a prompt reused no more KV than it did: the reasons, and the cache's short memory of
rows that are gone (evicted, expired, unreadable, saves dropped) or not there yet (saves in
flight), so that a later lookup can name what would have served it.

Cheap by construction: a reason is an enum member and a few numbers (``ReuseReport``); no
text is built where a request is planned. Text is rendered at the edges (the server's
``timings``, its log line, the chat page, ``kvwarm cache explain``) from ``MissReason.value``
and ``REASON_TEXT``.

``MissHistory`` is bounded twice: at most ``max_rows`` gone rows and ``max_tokens`` of their
tokens (the oldest leave first), held in a prefix tree of their own (``PrefixIndex``, one per
namespace as in the index) so that asking "did a gone row share more than N tokens with this
prompt?" is one tree walk. Saves in flight are few (the writer queue bounds them) and are
compared one by one. Memory is per process: a restart forgets what was evicted before it.

Invariants:

- A key republished (saved again, adopted) leaves the history: a live row is never also
  reported gone.
- The history has its own lock, taken last: the index may call it under the index lock; it
  never calls back into the index.
- Lookups are confined to the namespace asked for; whoever asks decides which namespaces a
  request may learn about (the engine never looks across cache salts: ``docs/architecture.md``,
  "Tenants").
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwarm.cache.index.prefix import PrefixIndex
from kvwarm.cache.types import Namespace, TierName
from kvwarm.tokens import common_prefix

__all__ = [
    "REASON_TEXT",
    "TTL_NAMES",
    "MissHistory",
    "MissReason",
    "ReuseReport",
    "describe",
    "reuse_json",
]


class MissReason(enum.Enum):
    """Why the prompt tokens after the reused ones were prefilled. The value is the stable
    name the server, the log line, the page and the metric label use."""

    NONE = "none"  # the whole prompt was reused: nothing was prefilled
    LAST_TOKEN = "last_token"  # all but the last token: its logits are needed, the row had none
    NEW_TOKENS = "new_tokens"  # everything any source shared was reused; the rest was never seen
    NO_PREFIX = "no_prefix"  # no row and no slot shares a prefix with the prompt
    ALIGNED_TRIM = "aligned_trim"  # deterministic mode kept an n_batch-aligned canonical prefix
    MEMORY_FLOOR = "memory_floor"  # the model's memory cannot resume there (kvwarm.memory)
    EVICTED = "evicted"  # the row that shared more was evicted (tier, policy, when)
    EXPIRED = "expired"  # ... expired (TTL class, when)
    UNREADABLE = "unreadable"  # ... failed to read (corrupt, a chunk missing): dropped
    OTHER_NAMESPACE = "other_namespace"  # a row shares more under another adapter set/context
    SAVE_DROPPED = "save_dropped"  # the save that would have served it was dropped or failed
    SAVE_IN_FLIGHT = "save_in_flight"  # ... is still being written
    RESTORE_FAILED = "restore_failed"  # the chosen row could not be restored: prefilled cold
    PROMPT_LOGPROBS = "prompt_logprobs"  # every prompt position's logits were asked for
    INSIDE_SPAN = "inside_span"  # the reusable prefix ended inside an image's or audio's span
    MEDIA_DIFFERS = "media_differs"  # the source goes on with other content where an image starts


#: One line per reason, for people (log line, CLI, docs). The page keeps its own copy.
REASON_TEXT: dict[MissReason, str] = {
    MissReason.NONE: "the whole prompt came from the cache",
    MissReason.LAST_TOKEN: "the last prompt token was decoded for its logits",
    MissReason.NEW_TOKENS: "the rest of the prompt was never cached",
    MissReason.NO_PREFIX: "no cached row or slot shares a prefix with the prompt",
    MissReason.ALIGNED_TRIM: "deterministic mode reuses only a prefix aligned to n_batch",
    MissReason.MEMORY_FLOOR: "the model's memory cannot resume there (no checkpoint at or below)",
    MissReason.EVICTED: "the row that shared more was evicted",
    MissReason.EXPIRED: "the row that shared more expired",
    MissReason.UNREADABLE: "the row that shared more failed to read and was dropped",
    MissReason.OTHER_NAMESPACE: "a row shares more under another adapter set or context",
    MissReason.SAVE_DROPPED: "the save that would have served it was dropped",
    MissReason.SAVE_IN_FLIGHT: "the save that would have served it is still being written",
    MissReason.RESTORE_FAILED: "the row could not be restored",
    MissReason.PROMPT_LOGPROBS: "prompt logprobs need every position's logits",
    MissReason.INSIDE_SPAN: "the reusable prefix ended inside an image or audio, decoded whole",
    MissReason.MEDIA_DIFFERS: "the prompt's image or audio differs from what was cached there",
}

#: ``TtlClass`` names by value, without building a string per expiry.
TTL_NAMES: tuple[str, ...] = ("short", "long", "extended")


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """What the planner found and why it reused no more.

    ``found_tokens``: the most prompt tokens any source shared (a live row or slot, or the
    gone/in-flight/other-namespace row the reason names); ``reused_tokens``: what was kept
    (``CompletionStats.cached_tokens``). ``age_s``: seconds since the row left (or the save
    started); ``tier``: where it lived or was going; ``detail``: the eviction policy
    (``lru``, ``lfu``, ``deleted``), the TTL class, ``corrupt``/``missing``, ``queue_full``/
    ``failed``/``pack_failed``, or what differs in the other namespace (``fingerprint``,
    ``context``)."""

    reason: MissReason
    found_tokens: int = 0
    reused_tokens: int = 0
    age_s: float | None = None
    tier: TierName = ""
    detail: str = ""


def reuse_json(report: ReuseReport) -> dict[str, object]:
    """The report as the server's ``timings.cache_reason`` and ``kvwarm cache explain --json``
    give it: the enum's value and the numbers; text is the reader's (the page has its own)."""
    out: dict[str, object] = {
        "reason": report.reason.value,
        "found_tokens": report.found_tokens,
        "reused_tokens": report.reused_tokens,
    }
    if report.age_s is not None:
        out["age_s"] = round(report.age_s, 3)
    if report.tier:
        out["tier"] = report.tier
    if report.detail:
        out["detail"] = report.detail
    return out


def describe(report: ReuseReport) -> str:
    """One line for people: the reason's text with its numbers."""
    text = f"{report.reason.value}: {REASON_TEXT[report.reason]}"
    bits = [f"found {report.found_tokens}", f"reused {report.reused_tokens}"]
    if report.tier:
        bits.append(f"tier {report.tier}")
    if report.detail:
        bits.append(report.detail)
    if report.age_s is not None:
        bits.append(f"{report.age_s:.0f} s ago")
    return f"{text} ({', '.join(bits)})"


@dataclass(frozen=True, slots=True)
class _Gone:
    reason: MissReason
    at: float
    tier: TierName
    detail: str
    n_tokens: int


class MissHistory:
    """Bounded memory of gone rows and of saves in flight (see the module docstring)."""

    def __init__(
        self,
        *,
        max_rows: int = 256,
        max_tokens: int = 1 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_rows = max(1, max_rows)
        self._max_tokens = max(1, max_tokens)
        self._clock = clock
        self._lock = threading.Lock()
        self._tree = PrefixIndex()
        self._gone: OrderedDict[bytes, _Gone] = OrderedDict()
        self._n_tokens = 0
        self._saving: dict[bytes, tuple[Namespace, Sequence[int], TierName, float]] = {}

    def __len__(self) -> int:
        return len(self._gone)

    # ----------------------------------------------------------------- recording

    def gone(
        self,
        namespace: Namespace,
        key: bytes,
        tokens: Sequence[int],
        reason: MissReason,
        tier: TierName,
        detail: str = "",
    ) -> None:
        """A row left (or a save was dropped): remember it, forgetting the oldest beyond the
        bounds. A row longer than the token bound is not remembered."""
        n = len(tokens)
        if n == 0 or n > self._max_tokens:
            return
        entry = _Gone(reason, self._clock(), tier, detail, n)
        with self._lock:
            self._drop(key)
            try:
                self._tree.insert(namespace, key, tokens, 0)
            except ValueError:  # tokens out of range: nothing a lookup could match
                return
            self._gone[key] = entry
            self._n_tokens += n
            while len(self._gone) > self._max_rows or self._n_tokens > self._max_tokens:
                self._drop(next(iter(self._gone)))

    def republished(self, key: bytes) -> None:
        """The key is a live row again."""
        if key in self._gone:
            with self._lock:
                self._drop(key)

    def saving(
        self, key: bytes, namespace: Namespace, tokens: Sequence[int], tier: TierName
    ) -> None:
        """A save of ``tokens`` was accepted; ``saved`` ends it (published, failed, dropped)."""
        with self._lock:
            self._saving[key] = (namespace, tokens, tier, self._clock())

    def saved(self, key: bytes) -> None:
        with self._lock:
            self._saving.pop(key, None)

    def _drop(self, key: bytes) -> None:
        old = self._gone.pop(key, None)
        if old is not None:
            self._n_tokens -= old.n_tokens
            self._tree.remove(key)

    # ----------------------------------------------------------------- asking

    def lookup(
        self, namespace: Namespace, tokens: Sequence[int], beyond: int
    ) -> ReuseReport | None:
        """The gone row or save in flight of ``namespace`` that shares the most of ``tokens``,
        if it shares more than ``beyond`` tokens (``reused_tokens`` left 0 for the caller)."""
        now = self._clock()
        best: ReuseReport | None = None
        with self._lock:
            for ns, saving, tier, started in self._saving.values():
                if ns != namespace:
                    continue
                shared = common_prefix(saving, tokens)
                if shared > beyond and (best is None or shared > best.found_tokens):
                    best = ReuseReport(
                        MissReason.SAVE_IN_FLIGHT, shared, 0, max(0.0, now - started), tier
                    )
            found = self._tree.longest(namespace, tokens) if self._gone else None
            if found is not None:
                key, shared = found
                entry = self._gone[key]
                if shared > beyond and (best is None or shared > best.found_tokens):
                    best = ReuseReport(
                        entry.reason,
                        shared,
                        0,
                        max(0.0, now - entry.at),
                        entry.tier,
                        entry.detail,
                    )
        return best
