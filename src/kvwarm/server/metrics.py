"""``/metrics``: the cache, the models and the HTTP server, through ``prometheus_client``.

Invariants:
- No module-level metric state: every app owns one ``ServerMetrics``, with its own
  ``CollectorRegistry``; two apps in one process (tests) never see each other's counts (except
  in multiprocess mode, where prometheus_client keeps counts per process, not per registry).
- Event counters (HTTP requests, finished generations, client disconnects) are
  ``prometheus_client.Counter`` objects, counted when the event happens. With
  ``PROMETHEUS_MULTIPROC_DIR`` set (as prometheus_client requires: before the process imports
  it, to an empty directory shared by the replicas on one host) they live in that directory's
  files, and every replica's ``/metrics`` reports the sum over all replicas, the dead included.
- Engine and cache values (queue depth, tokens, cache tiers ...) are read from snapshots
  (``Cache.counters()``, ``Model.status()``) at scrape time by ``SnapshotCollector`` and never
  take a lock a worker holds while decoding, so scraping cannot slow generation. They describe
  the replica that answered (each replica owns its engine): scrape replicas one by one for them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvwarm.cache.types import MEMORY_SERIES, TIER_SERIES, TIER_TOTALS
from kvwarm.engine.types import ModelStatus
from kvwarm.server.budget import MemoryPlan

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_BAD_NAME = re.compile(r"[^a-zA-Z0-9_]")
# tier_<any tier name>_<series>: the name is whatever was configured (the shortest that leaves
# a known series, so ram_file_bytes is tier ram_file, series bytes).
# Levels are gauges (kvwarm_cache_tier_<series>), running totals counters
# (kvwarm_cache_tier_<series>_total: restores, their bytes and seconds).
_TIER_KEY = re.compile(
    r"^tier_([A-Za-z0-9_]+?)_("
    + "|".join(sorted(map(re.escape, (*TIER_SERIES, *TIER_TOTALS)), key=len, reverse=True))
    + r")$"
)
# memory_<kind>_<series>: what the rows of one memory kind store and restore.
_MEMORY_KEY = re.compile(
    r"^memory_([a-z]+)_("
    + "|".join(sorted(map(re.escape, MEMORY_SERIES), key=len, reverse=True))
    + r")$"
)
# Cache counters that are levels, not running totals (tier_* levels are matched separately).
_GAUGES = frozenset({"rows", "reservations", "inflight", "in_flight", "queued", "writer_queued"})


def _name(text: str) -> str:
    name = _BAD_NAME.sub("_", text)
    return name if not name[:1].isdigit() else "_" + name


@dataclass(slots=True)
class _Family:
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


class Families:
    """Samples grouped into prometheus_client metric families (one family per name, as the
    exposition formats require), built from snapshot values."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, name: str, kind: str, help_text: str, value: float, **labels: str) -> None:
        family = self._families.setdefault(_name(name), _Family(kind, help_text))
        family.samples.append(({_name(k): v for k, v in labels.items()}, float(value)))

    def metrics(self) -> Iterator[Metric]:
        for name, family in self._families.items():
            label_names = sorted({k for labels, _ in family.samples for k in labels})
            metric: GaugeMetricFamily | CounterMetricFamily
            if family.kind == "counter":
                metric = CounterMetricFamily(name, family.help, labels=label_names)
            else:
                metric = GaugeMetricFamily(name, family.help, labels=label_names)
            for labels, value in family.samples:
                metric.add_metric([labels.get(k, "") for k in label_names], value)
            yield metric

    def render(self) -> str:
        """The text exposition of these families alone."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Static(list(self.metrics())))
        encoder, _ = choose_encoder("")
        return encoder(registry).decode()


class _Static(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics


_TIER_TOTALS_HELP = {
    "restores": "rows a tier restored into a request's slot (not its hits: rows opened)",
    "restored_bytes": "KV bytes a tier's restores read",
    "restore_seconds": "time a tier's restores took, from opening the row to its KV in the slot",
}
assert set(_TIER_TOTALS_HELP) == set(TIER_TOTALS)


def add_cache(out: Families, counters: Mapping[str, float]) -> None:
    for key in sorted(counters):
        value = float(counters[key])
        tier = _TIER_KEY.match(key)
        if tier is not None and tier.group(2) in TIER_TOTALS:
            out.add(
                f"kvwarm_cache_tier_{tier.group(2)}_total",
                "counter",
                _TIER_TOTALS_HELP[tier.group(2)],
                value,
                tier=tier.group(1),
            )
        elif tier is not None:
            out.add(
                f"kvwarm_cache_tier_{tier.group(2)}",
                "gauge",
                f"cache tier {tier.group(2).replace('_', ' ')}",
                value,
                tier=tier.group(1),
            )
        elif (memory := _MEMORY_KEY.match(key)) is not None:
            out.add(
                f"kvwarm_cache_memory_{memory.group(2)}",
                "gauge",
                f"cache rows of one memory kind: {memory.group(2).replace('_', ' ')}",
                value,
                memory=memory.group(1),
            )
        elif key in _GAUGES:
            out.add(f"kvwarm_cache_{key}", "gauge", f"cache {key.replace('_', ' ')}", value)
        else:
            out.add(f"kvwarm_cache_{key}_total", "counter", f"cache {key.replace('_', ' ')}", value)


# (metric, kind, help, ModelStatus attribute, scale)
_MODEL_SERIES: tuple[tuple[str, str, str, str, float], ...] = (
    ("kvwarm_model_queue_depth", "gauge", "requests waiting for a slot", "queued", 1),
    ("kvwarm_model_active", "gauge", "requests holding a slot", "active", 1),
    ("kvwarm_model_slots", "gauge", "slots (n_parallel)", "n_parallel", 1),
    ("kvwarm_model_free_slots", "gauge", "slots free for the next request", "free_slots", 1),
    ("kvwarm_model_kv_cells_used", "gauge", "context (KV) cells in use", "kv_cells_used", 1),
    (
        "kvwarm_model_kv_cells",
        "gauge",
        "context (KV) cells in all (n_ctx for each of the n_parallel slots)",
        "kv_cells",
        1,
    ),
    (
        "kvwarm_model_kv_cache_usage_ratio",
        "gauge",
        "share of the context's cells in use, 0..1",
        "kv_cache_usage",
        1,
    ),
    (
        "kvwarm_requests_total",
        "counter",
        "requests ended, by any finish reason (cancelled ones too, queued or running); "
        "not prewarms, nor requests that failed",
        "requests",
        1,
    ),
    ("kvwarm_prompt_tokens_total", "counter", "prompt tokens", "prompt_tokens", 1),
    (
        "kvwarm_cached_tokens_total",
        "counter",
        "prompt tokens reused (restored from the cache or kept in a slot's live KV)",
        "cached_tokens",
        1,
    ),
    (
        "kvwarm_prefilled_tokens_total",
        "counter",
        "prompt tokens run through the model (not restored, not shared by n > 1 choices)",
        "prefilled_tokens",
        1,
    ),
    ("kvwarm_completion_tokens_total", "counter", "generated tokens", "completion_tokens", 1),
    (
        "kvwarm_spec_draft_tokens_total",
        "counter",
        "speculative decoding: tokens drafted into verify passes",
        "drafted_tokens",
        1,
    ),
    (
        "kvwarm_spec_accepted_tokens_total",
        "counter",
        "speculative decoding: drafted tokens the model accepted",
        "accepted_tokens",
        1,
    ),
    (
        "kvwarm_spec_verify_passes_total",
        "counter",
        "speculative decoding: a slot's passes that verified a draft",
        "verify_passes",
        1,
    ),
    (
        "kvwarm_spec_filler_rows_total",
        "counter",
        "speculative decoding: filler rows that padded a verify pass to a whole tile of the "
        "CPU's matrix kernel (cheaper than the rows past it)",
        "filler_rows",
        1,
    ),
    (
        "kvwarm_prefill_seconds_total",
        "counter",
        "time spent in prefill, once per prefill run (n > 1 choices share one)",
        "prefill_ms",
        1e-3,
    ),
    ("kvwarm_decode_seconds_total", "counter", "time spent generating", "generation_ms", 1e-3),
    # The cache's upkeep (Model.prewarm: keep-alive's re-warms, /cache/prewarm,
    # --prewarm-system), in none of the request counters above.
    (
        "kvwarm_prewarms_total",
        "counter",
        "prewarms ended (keep-alive re-warms, /cache/prewarm, --prewarm-system): not requests",
        "prewarms",
        1,
    ),
    (
        "kvwarm_prewarm_prompt_tokens_total",
        "counter",
        "prewarms' prompt tokens",
        "prewarm_prompt_tokens",
        1,
    ),
    (
        "kvwarm_prewarm_cached_tokens_total",
        "counter",
        "prewarms' prompt tokens reused (restored from the cache or kept in a slot's live KV)",
        "prewarm_cached_tokens",
        1,
    ),
    (
        "kvwarm_prewarm_prefilled_tokens_total",
        "counter",
        "prewarms' prompt tokens run through the model",
        "prewarm_prefilled_tokens",
        1,
    ),
    (
        "kvwarm_prewarm_seconds_total",
        "counter",
        "time prewarms spent in prefill",
        "prewarm_ms",
        1e-3,
    ),
)


def add_models(
    out: Families,
    states: Mapping[str, str],
    statuses: Iterable[ModelStatus],
    totals: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """Each model's state, its loaded instance's levels (``statuses``) and its running totals:
    ``totals`` (``server/totals.py``: over every load of it, so a counter never goes down when
    a model unloads or loads again), or without them the loaded instances' own counts."""
    statuses = list(statuses)
    if totals is None:
        totals = {s.id: model_totals_of(s) for s in statuses}
    for model_id, state in states.items():
        out.add("kvwarm_model_ready", "gauge", "1 if the model is ready", state == "ready",
                model=model_id)  # fmt: skip
    for s in statuses:
        for name, kind, help_text, attr, scale in _MODEL_SERIES:
            if kind != "counter":
                out.add(name, kind, help_text, float(getattr(s, attr)) * scale, model=s.id)
    for model_id, counts in totals.items():
        for name, kind, help_text, attr, scale in _MODEL_SERIES:
            if kind == "counter":
                out.add(name, kind, help_text, counts.get(attr, 0.0) * scale, model=model_id)


#: The ``ModelStatus`` fields that are running totals, the model's counters here (the others
#: are levels: queue, slots); ``server/totals.py`` keeps them over every load of a model.
MODEL_TOTALS: tuple[str, ...] = tuple(
    attr for _, kind, _, attr, _ in _MODEL_SERIES if kind == "counter"
)


def model_totals_of(status: ModelStatus) -> dict[str, float]:
    """``status``'s running totals (``MODEL_TOTALS``)."""
    return {name: float(getattr(status, name)) for name in MODEL_TOTALS}


def add_memory(out: Families, plan: MemoryPlan) -> None:
    """Each model's weights, KV and context bytes, the budget and the planned total (the
    tiers' quotas and use are ``kvwarm_cache_tier_quota_bytes`` / ``_bytes``)."""
    for m in plan.models:
        out.add("kvwarm_model_weights_bytes", "gauge", "model weights in memory",
                m.weights_bytes, model=m.model)  # fmt: skip
        out.add("kvwarm_model_kv_bytes", "gauge", "the model's context KV buffers",
                m.kv_bytes, model=m.model)  # fmt: skip
        out.add("kvwarm_model_context_bytes", "gauge",
                "all the model's context buffers (KV, output, compute)",
                m.context_bytes, model=m.model)  # fmt: skip
    out.add("kvwarm_memory_budget_bytes", "gauge", "the memory budget (0: none)",
            plan.budget_bytes)  # fmt: skip
    out.add("kvwarm_memory_planned_bytes", "gauge",
            "weights + contexts + in-memory tier quotas (the RAM tier's included)",
            plan.total_bytes)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape reads from the engine and the server state."""

    cache: Mapping[str, float] = field(default_factory=dict)
    states: Mapping[str, str] = field(default_factory=dict)
    statuses: Sequence[ModelStatus] = ()
    keepalive_prefixes: int = 0
    stalled_s: Mapping[str, float] = field(default_factory=dict)
    memory: MemoryPlan | None = None  # the memory budget's plan (server/budget.py)
    #: Per model id, its running totals over the server's lifetime (server/totals.py); None:
    #: the statuses' own counts.
    totals: Mapping[str, Mapping[str, float]] | None = None


class SnapshotCollector(Collector):
    """A custom collector: engine and cache values, read when scraped."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        return ()  # names depend on the cache's counters; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        snap = self._read()
        out = Families()
        add_cache(out, snap.cache)
        add_models(out, snap.states, snap.statuses, snap.totals)
        for model_id, age in snap.stalled_s.items():
            out.add("kvwarm_worker_stalled_seconds", "gauge",
                    "seconds the worker's current iteration has run without ticking (0 idle)",
                    age, model=model_id)  # fmt: skip
        out.add("kvwarm_keepalive_prefixes", "gauge", "prefixes kept warm",
                snap.keepalive_prefixes)  # fmt: skip
        if snap.memory is not None:
            add_memory(out, snap.memory)
        return list(out.metrics())


class ServerMetrics:
    """One app's metrics: a private registry, the event counters and the snapshot collector."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        # prometheus_client picks its value store (memory or the directory's files) from this
        # variable when it is first imported; reading it here too keeps the two in step.
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        self.registry = CollectorRegistry(auto_describe=False)
        self.snapshot = SnapshotCollector(read)
        self.registry.register(self.snapshot)
        self.http_requests = Counter(
            "kvwarm_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.generations = Counter(
            "kvwarm_generations",
            "HTTP generations by finish reason",
            ["model", "reason"],
            registry=self.registry,
        )
        self.cache_reasons = Counter(
            "kvwarm_cache_reasons",
            "HTTP generations by why no more of the prompt came from the cache "
            "(kvwarm.cache.explain.MissReason: none, new_tokens, evicted, ...)",
            ["model", "reason"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "kvwarm_client_disconnects",
            "generations cancelled because the client went away",
            registry=self.registry,
        )

    def record(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def record_finish(self, model_id: str, reason: str, disconnected: bool) -> None:
        self.generations.labels(model=model_id, reason=reason).inc()
        if disconnected:
            self.client_disconnects.inc()

    def record_cache_reason(self, model_id: str, reason: str) -> None:
        self.cache_reasons.labels(model=model_id, reason=reason).inc()

    def scrape_registry(self) -> CollectorRegistry:
        """The registry a scrape renders: this app's, or, in multiprocess mode, the counters
        summed over every replica's files plus this replica's snapshot."""
        if self.multiproc_dir is None:
            return self.registry
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=self.multiproc_dir)  # type: ignore[no-untyped-call]
        registry.register(self.snapshot)
        return registry

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The body and content type for a scrape; OpenMetrics if the scraper asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.scrape_registry()), content_type
