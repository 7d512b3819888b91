"""Pure policy decisions: save boundaries, save gates and configuration validation.

Invariant: nothing here does I/O, reads a clock or keeps state; every function is a plain
transformation of its arguments, so the engine's save decisions are testable as data.

Boundaries. A cold save persists a *trimmed, aligned* prefix of the prompt, not the whole
prompt: dropping the last ``boundary_trim_tokens`` keeps the row valid for the next request
whose text extends this one (BPE may re-tokenise the tail differently), and aligning down to a
multiple of ``boundary_align_tokens`` makes the saved state one that a chunked prefill at
absolute n_batch multiples reproduces bit-for-bit (the rule and its reason: ``kvwarm.alignment``).

Probes. A shared tier answers only "does this key exist", so a prefix lookup there asks for
the keys of the prefixes a save could have produced (``probe_lengths``): the cold-save
boundaries (the only save lengths a lookup can predict without knowing the other prompt) and
the prompt's own length (a finish, evict or prewarm row of exactly this prompt) and, in a chat,
where each earlier turn ended (that turn's finish save).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from kvwarm.alignment import align_down
from kvwarm.cache.eviction.base import registered_policies
from kvwarm.cache.tiers.registry import check_name, registered_tiers, tier_spec, url_scheme
from kvwarm.cache.types import CacheConfig, PolicyConfig, PressureConfig, TierConfig
from kvwarm.errors import ConfigError

__all__ = [
    "aligned_boundary",
    "cold_save_length",
    "cold_save_lengths",
    "probe_lengths",
    "should_continued_save",
    "should_finish_save",
    "validate_cache_config",
    "validate_policy",
    "validate_pressure_config",
    "validate_tier_config",
]


def aligned_boundary(n_tokens: int, trim: int, align: int) -> int:
    """``n_tokens - trim`` rounded down to a multiple of ``align``; 0 when nothing is left.

    ``align`` of 1 means "no alignment". Negative inputs are programming errors.
    """
    if n_tokens < 0 or trim < 0 or align < 1:
        raise ValueError(f"bad boundary arguments n={n_tokens} trim={trim} align={align}")
    usable = n_tokens - trim
    if usable <= 0:
        return 0
    return align_down(usable, align)


def cold_save_length(n_tokens: int, policy: PolicyConfig) -> int:
    """How many leading prompt tokens a cold save after prefilling ``n_tokens`` persists.

    0 means "no cold save": the prompt is under ``cold_min_tokens``, or the trimmed aligned
    boundary is under ``min_tokens``. Prompts longer than ``cold_max_tokens`` are capped (the
    cap itself aligned down) rather than skipped: their head is still worth keeping.
    """
    if n_tokens < policy.cold_min_tokens:
        return 0
    boundary = aligned_boundary(n_tokens, policy.boundary_trim_tokens, policy.boundary_align_tokens)
    cap = policy.cold_max_tokens - policy.cold_max_tokens % policy.boundary_align_tokens
    boundary = min(boundary, cap)
    if boundary <= 0 or boundary < policy.min_tokens:
        return 0
    return boundary


def cold_save_lengths(limit: int, policy: PolicyConfig, n_batch: int) -> tuple[int, ...]:
    """Every length up to ``limit`` that a cold save can write, longest first: the engine
    saves ``align_down(cold_save_length(m), n_batch)`` tokens of an m-token prompt
    (``engine/worker/cacheport.py``), which for some m is each multiple of ``boundary_align_tokens``
    from ``min_tokens`` up to the aligned ``cold_max_tokens``, aligned down to ``n_batch``."""
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    align = policy.boundary_align_tokens
    cap = min(limit, policy.cold_max_tokens - policy.cold_max_tokens % align)
    out: list[int] = []
    for boundary in range(cap - cap % align, 0, -align):
        length = align_down(boundary, n_batch)
        if length < max(1, policy.min_tokens):
            break
        if not out or out[-1] != length:
            out.append(length)
    return tuple(out)


def probe_lengths(
    n_tokens: int, policy: PolicyConfig, n_batch: int, *, turn_ends: Sequence[int] = ()
) -> tuple[int, ...]:
    """Prefix lengths of an ``n_tokens`` prompt worth probing in a shared tier, longest first.

    - the prompt itself: a row of exactly these tokens (finish, evict, prewarm);
    - each ``turn_ends`` position ``i`` (where an end-of-turn token sits in the prompt) and
      ``i - 1``: a chat follow-up repeats the previous reply before its end-of-turn token, and
      that turn's finish save holds the prompt and the reply up to there (a reply stopped by
      an end-of-generation token: ``i``; cut by ``max_tokens``, whose last token is never
      decoded: ``i - 1``);
    - every cold-save length below the prompt's (``cold_save_lengths``).

    Nothing shorter than ``min_tokens``: no save writes such a row."""
    floor = max(1, policy.min_tokens)
    if n_tokens < floor:
        return ()
    found = {n_tokens, *cold_save_lengths(n_tokens, policy, n_batch)}
    for end in turn_ends:
        found.update(n for n in (end, end - 1) if floor <= n <= n_tokens)
    return tuple(sorted(found, reverse=True))


def should_continued_save(live_tokens: int, last_saved_at: int, policy: PolicyConfig) -> bool:
    """True once ``continued_interval`` tokens were added since the last save of this slot."""
    if live_tokens < policy.min_tokens:
        return False
    return live_tokens - last_saved_at >= policy.continued_interval


def should_finish_save(live_tokens: int, policy: PolicyConfig) -> bool:
    """A finish save (prompt + reply) is worth writing once it clears ``min_tokens``."""
    return live_tokens >= policy.min_tokens


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need_int(obj: str, name: str, value: object, *, minimum: int) -> None:
    if not _is_int(value):
        raise ConfigError(f"{obj}.{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise ConfigError(f"{obj}.{name} must be >= {minimum}, got {value}")


def _need_number(obj: str, name: str, value: object, *, minimum: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{obj}.{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{obj}.{name} must be >= {minimum}, got {value}")
    return float(value)


def validate_policy(policy: PolicyConfig) -> None:
    """``ConfigError`` naming the first bad field of a ``PolicyConfig``."""
    obj = "policy"
    for name in ("min_tokens", "cold_min_tokens", "boundary_trim_tokens", "checkpoint_gap_tokens"):
        _need_int(obj, name, getattr(policy, name), minimum=0)
    for name in ("session_resume_wait_ms", "evict_save_timeout_ms"):
        _need_int(obj, name, getattr(policy, name), minimum=0)
    _need_int(obj, "cold_max_tokens", policy.cold_max_tokens, minimum=1)
    _need_int(obj, "continued_interval", policy.continued_interval, minimum=1)
    _need_int(obj, "boundary_align_tokens", policy.boundary_align_tokens, minimum=1)
    if policy.cold_min_tokens > policy.cold_max_tokens:
        raise ConfigError(
            f"policy.cold_min_tokens ({policy.cold_min_tokens}) exceeds "
            f"cold_max_tokens ({policy.cold_max_tokens}): no cold save could ever happen"
        )


def validate_tier_config(tier: TierConfig) -> None:
    if tier.url is not None:
        check_name(tier.name)
        url_scheme(tier.url)  # ConfigError for a scheme no store registered
        _need_int(f"tier {tier.name}", "quota_bytes", tier.quota_bytes, minimum=0)
        if tier.root is not None or tier.s3 is not None or tier.shared:
            raise ConfigError(f"tier {tier.name}: a URL names the store; root/shared/s3 go")
        return
    spec = tier_spec(tier.name)  # ConfigError for a name no tier registered
    _need_int(f"tier {tier.name}", "quota_bytes", tier.quota_bytes, minimum=0)
    if not spec.needs_root:
        if tier.root is not None:
            raise ConfigError(f"tier {tier.name} takes no root directory (it is not a file tier)")
    elif tier.root is None:
        raise ConfigError(f"tier {tier.name} is a file tier and needs a root directory")
    if tier.shared and not spec.needs_root:
        raise ConfigError(f"tier {tier.name}: only a file tier's directory can be marked shared")


def validate_pressure_config(cfg: PressureConfig, configured: Collection[str] = ()) -> None:
    obj = "pressure"
    if cfg.source not in ("noop", "system", "nvidia"):
        raise ConfigError(f"pressure.source must be noop, system or nvidia, got {cfg.source!r}")
    _need_int(obj, "interval_ms", cfg.interval_ms, minimum=1)
    _need_int(obj, "min_evict_bytes", cfg.min_evict_bytes, minimum=0)
    high = _need_number(obj, "high_watermark", cfg.high_watermark, minimum=0.0)
    low = _need_number(obj, "low_watermark", cfg.low_watermark, minimum=0.0)
    if not 0.0 < high <= 1.0:
        raise ConfigError(f"pressure.high_watermark must be in (0, 1], got {high}")
    if low >= high:
        raise ConfigError(
            f"pressure.low_watermark ({low}) must be below high_watermark ({high}), "
            "otherwise eviction can never bring the ratio back under the low mark"
        )
    if not cfg.evict_tiers:
        raise ConfigError("pressure.evict_tiers is empty: the scheduler could evict nothing")
    for name in cfg.evict_tiers:
        if name not in registered_tiers() and name not in configured:
            raise ConfigError(f"pressure.evict_tiers names unknown tier {name!r}")


def validate_cache_config(cfg: CacheConfig) -> None:
    """``ConfigError`` for any inconsistency in a ``CacheConfig``; called by ``Cache``."""
    if not cfg.tiers:
        raise ConfigError("cache needs at least one tier")
    seen: set[str] = set()
    roots: dict[str, str] = {}
    for tier in cfg.tiers:
        validate_tier_config(tier)
        if tier.name in seen:
            raise ConfigError(f"tier {tier.name} configured twice")
        seen.add(tier.name)
        if tier.root is not None:
            root = str(tier.root)
            if root in roots:
                # Two tiers scanning one directory would adopt (and evict) each other's rows.
                raise ConfigError(f"tiers {roots[root]} and {tier.name} share the root {root}")
            roots[root] = tier.name
    _need_int("cache", "writer_threads", cfg.writer_threads, minimum=1)
    _need_int("cache", "writer_queue", cfg.writer_queue, minimum=1)
    _need_number("cache", "reservation_ttl_s", cfg.reservation_ttl_s, minimum=0.001)
    _need_number("cache", "sweep_interval_s", cfg.sweep_interval_s, minimum=0.001)
    _need_int("cache", "probe_max", cfg.probe_max, minimum=0)
    _need_int("cache", "probe_parallel", cfg.probe_parallel, minimum=1)
    _need_int("cache", "chunk_tokens", cfg.chunk_tokens, minimum=0)
    if cfg.promote_tier is not None and cfg.promote_tier not in seen:
        raise ConfigError(f"cache.promote_tier names a tier not configured: {cfg.promote_tier}")
    if len(cfg.ttl_seconds) != 3:
        raise ConfigError("cache.ttl_seconds needs three values: short, long, extended")
    for i, ttl in enumerate(cfg.ttl_seconds):
        _need_number("cache", f"ttl_seconds[{i}]", ttl, minimum=0.001)
    if cfg.eviction not in registered_policies():
        known = ", ".join(registered_policies())
        raise ConfigError(f"cache.eviction {cfg.eviction!r} is unknown; expected one of {known}")
    validate_pressure_config(cfg.pressure, seen)
