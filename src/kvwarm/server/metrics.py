"""Prometheus text exposition (format 0.0.4) of the cache, the models and the HTTP server.

Invariant: rendering reads snapshots only (``Cache.counters()``, ``Model.status()``, the
request counters) and never takes a lock a worker holds while decoding, so scraping cannot
slow generation. Metric and label names are sanitised; label values are escaped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvwarm.cache.types import TIER_NAMES
from kvwarm.engine.types import ModelStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BAD_NAME = re.compile(r"[^a-zA-Z0-9_]")
_TIER_KEY = re.compile(r"^tier_(" + "|".join(TIER_NAMES) + r")_(.+)$")
# Cache counters that are levels, not running totals (tier_* levels are matched separately).
_GAUGES = frozenset({"rows", "reservations", "inflight", "in_flight", "queued", "writer_queued"})


def _name(text: str) -> str:
    name = _BAD_NAME.sub("_", text)
    return name if not name[:1].isdigit() else "_" + name


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass(slots=True)
class _Family:
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


class Exposition:
    """Families keep their samples together, as the text format requires."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, name: str, kind: str, help_text: str, value: float, **labels: str) -> None:
        name = _name(name)
        family = self._families.setdefault(name, _Family(kind, help_text))
        family.samples.append((labels, value))

    def render(self) -> str:
        lines: list[str] = []
        for name, family in self._families.items():
            lines.append(f"# HELP {name} {family.help}")
            lines.append(f"# TYPE {name} {family.type}")
            for labels, value in family.samples:
                label_text = ",".join(f'{_name(k)}="{_escape(v)}"' for k, v in labels.items())
                braces = "{" + label_text + "}" if label_text else ""
                lines.append(f"{name}{braces} {_number(value)}")
        return "\n".join(lines) + "\n"


def add_cache(out: Exposition, counters: Mapping[str, float]) -> None:
    for key in sorted(counters):
        value = float(counters[key])
        tier = _TIER_KEY.match(key)
        if tier is not None:
            out.add(
                f"kvwarm_cache_tier_{tier.group(2)}",
                "gauge",
                f"cache tier {tier.group(2).replace('_', ' ')}",
                value,
                tier=tier.group(1),
            )
        elif key in _GAUGES:
            out.add(f"kvwarm_cache_{key}", "gauge", f"cache {key.replace('_', ' ')}", value)
        else:
            out.add(f"kvwarm_cache_{key}_total", "counter", f"cache {key.replace('_', ' ')}", value)


def add_models(out: Exposition, states: Mapping[str, str], statuses: Iterable[ModelStatus]) -> None:
    for model_id, state in states.items():
        out.add(
            "kvwarm_model_ready",
            "gauge",
            "1 if the model is ready",
            state == "ready",
            model=model_id,
        )
    for s in statuses:
        m = s.id
        out.add(
            "kvwarm_model_queue_depth", "gauge", "requests waiting for a slot", s.queued, model=m
        )
        out.add("kvwarm_model_active", "gauge", "requests holding a slot", s.active, model=m)
        out.add("kvwarm_model_slots", "gauge", "slots (n_parallel)", s.n_parallel, model=m)
        out.add("kvwarm_requests_total", "counter", "generations finished", s.requests, model=m)
        out.add("kvwarm_prompt_tokens_total", "counter", "prompt tokens", s.prompt_tokens, model=m)
        out.add(
            "kvwarm_cached_tokens_total",
            "counter",
            "prompt tokens restored from cache",
            s.cached_tokens,
            model=m,
        )
        out.add(
            "kvwarm_completion_tokens_total",
            "counter",
            "generated tokens",
            s.completion_tokens,
            model=m,
        )
        out.add(
            "kvwarm_prefill_seconds_total",
            "counter",
            "time spent in prefill",
            s.prefill_ms / 1000,
            model=m,
        )
        out.add(
            "kvwarm_decode_seconds_total",
            "counter",
            "time spent generating",
            s.generation_ms / 1000,
            model=m,
        )


def add_finished(
    out: Exposition, finished: Mapping[tuple[str, str], int], disconnects: int
) -> None:
    for (model_id, reason), count in sorted(finished.items()):
        out.add(
            "kvwarm_generations_total",
            "counter",
            "HTTP generations by finish reason",
            count,
            model=model_id,
            reason=reason,
        )
    out.add(
        "kvwarm_client_disconnects_total",
        "counter",
        "generations cancelled because the client went away",
        disconnects,
    )


def add_http(out: Exposition, by_route: Mapping[tuple[str, int], int]) -> None:
    for (route, status), count in sorted(by_route.items()):
        out.add(
            "kvwarm_http_requests_total",
            "counter",
            "HTTP requests by route and status",
            count,
            route=route,
            status=str(status),
        )
