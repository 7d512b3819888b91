"""How the cache settings become the cache's configuration: tiers, the save tier, checks.

Invariant: ``Settings`` declares the cache settings (``settings/__init__.py``); only this
module turns them into ``TierConfig``s, so the tier order (fastest first: ram, ram_file,
disk, then the shared s3 tier, then the ``tiers`` given by URL, in their order) and the rules
binding them live in one place. A store configured by URL needs no setting of its own: its
scheme picks it (``cache/tiers/registry.py``). See docs/architecture.md ("The cache",
"Shared tiers").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvwarm.cache.types import CacheConfig, S3Config, TierConfig, TierName
from kvwarm.cache.validate import validate_cache_config
from kvwarm.errors import ConfigError
from kvwarm.settings.types import path_kind

if TYPE_CHECKING:
    from kvwarm.settings import Settings

__all__ = ["cache_config", "check", "s3_config", "save_tier", "url_tier"]


def save_tier(s: Settings) -> TierName:
    if s.save_tier is not None:
        return s.save_tier
    if s.s3_bucket is not None:
        return "s3"  # a bucket is configured to share rows: the other replicas must see ours
    return "disk" if s.cache_dir is not None else "ram"


def s3_config(s: Settings) -> S3Config | None:
    if s.s3_bucket is None:
        return None
    return S3Config(
        bucket=s.s3_bucket,
        prefix=s.s3_prefix,
        endpoint_url=s.s3_endpoint_url,
        region=s.s3_region,
        connect_timeout_s=s.s3_connect_timeout_s,
        read_timeout_s=s.s3_read_timeout_s,
        max_attempts=s.s3_max_attempts,
        min_bytes_per_s=s.s3_min_bytes_per_s,
        packs=s.s3_packs,
    )


def cache_config(s: Settings) -> CacheConfig:
    """Tiers fastest first; lookups ask the local ones first and an s3 hit is copied to ram."""
    tiers = [TierConfig("ram", s.ram_quota_bytes)]
    if s.shm_dir is not None:
        tiers.append(TierConfig("ram_file", s.shm_quota_bytes, s.shm_dir))
    if s.cache_dir is not None:
        root = s.cache_dir / "rows"
        tiers.append(TierConfig("disk", s.disk_quota_bytes, root, shared=s.cache_dir_shared))
    s3 = s3_config(s)
    if s3 is not None:
        tiers.append(TierConfig("s3", s.s3_quota_bytes, s3=s3))
    tiers.extend(url_tier(spec) for spec in s.tiers)
    return CacheConfig(
        tiers=tuple(tiers),
        store_prompt_text=s.store_prompt_text,
        eviction=s.cache_eviction,
        chunk_tokens=s.cache_chunk_tokens,
        state_history=s.cache_state_history,
    )


def url_tier(spec: str) -> TierConfig:
    """``NAME=URL`` (the quota as the URL's ``quota=SIZE``, 1G if absent) as a
    ``TierConfig``; ``ConfigError`` if it is not that shape."""
    from kvwarm.cache.tiers.registry import shown_url
    from kvwarm.settings.types import as_size

    name, sep, url = spec.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or "://" not in url:
        # Its password masked (found by review: a URL given without its NAME= was shown
        # whole, password and all).
        shown = f"{name}={shown_url(url)}" if "://" in url else shown_url(spec.strip())
        raise ConfigError(
            f"tiers: a tier is NAME=URL (e.g. shared=redis://host:6379/0), got {shown!r}"
        )
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    quota = [v for k, v in query if k == "quota"]
    try:
        quota_bytes = as_size(quota[-1]) if quota else 1 << 30
    except ValueError as exc:
        raise ConfigError(f"tiers: tier {name}: quota: {exc}") from None
    rest = urlencode([(k, v) for k, v in query if k != "quota"])
    return TierConfig(name, quota_bytes, url=urlunsplit(parts._replace(query=rest)))


def _check_creatable(root: Path, name: str) -> None:
    """``ConfigError`` unless ``root``, which does not exist, can be made as a directory:
    its nearest existing ancestor is one, and it is no symbolic link to nowhere. Found by
    review: ``cache_dir`` a dangling link, or under a file, stopped the engine only once the
    server had started ("cannot create cache root", exit status 1)."""
    path = Path(os.path.expanduser(root))
    for part in (path, *path.parents):
        if part.is_symlink() and path_kind(part, name) == "missing":
            target = os.readlink(part)
            raise ConfigError(f"{name} {root}: {part} is a link to {target}, which does not exist")
        kind = path_kind(part, name)
        if kind == "missing":
            continue
        if kind != "dir":
            raise ConfigError(f"{name} {root} cannot be created: {part} is not a directory")
        return


def check(s: Settings) -> None:
    """``ConfigError`` for a save tier that is not configured, a chunk size that does not
    line up with n_batch, a state history below -1, or bad s3 settings."""
    c, b = s.cache_chunk_tokens, s.n_batch
    # Aligned restore boundaries (multiples of n_batch) then always fall on chunk boundaries.
    if c < 0 or (c and b % c and c % b):
        raise ConfigError(
            f"cache_chunk_tokens must be 0, a divisor or a multiple of n_batch ({b}), got {c}"
        )
    if s.cache_state_history < -1:
        raise ConfigError(
            f"cache_state_history must be -1 (keep every state) or more, got "
            f"{s.cache_state_history}"
        )
    for name in ("cache_dir", "shm_dir"):
        # Found by review: a file here stopped the engine only once the server had started
        # ("cache root /etc/passwd/rows is not a directory", exit status 1). One that does not
        # exist yet is created.
        root: Path | None = getattr(s, name)
        if root is None:
            continue
        kind = path_kind(root, name)
        if kind == "missing":
            _check_creatable(root, name)
        elif kind != "dir":
            raise ConfigError(f"{name} {root} is not a directory")
    tier = save_tier(s)
    if tier == "disk" and s.cache_dir is None:
        raise ConfigError("save_tier is disk but the disk tier is off (cache_dir none)")
    if tier == "ram_file" and s.shm_dir is None:
        raise ConfigError("save_tier is ram_file but no shm_dir is set")
    if tier == "s3" and s.s3_bucket is None:
        raise ConfigError("save_tier is s3 but no s3_bucket is set")
    # Checked with or without a bucket: a bad value must not wait for the day one is set.
    if s.s3_connect_timeout_s <= 0 or s.s3_read_timeout_s <= 0:
        raise ConfigError("s3_connect_timeout_s and s3_read_timeout_s must be > 0")
    if s.s3_max_attempts < 1:
        raise ConfigError("s3_max_attempts must be >= 1")
    names = [t.name for t in cache_config(s).tiers]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        # Found by review: the engine refused it only once the server had started (exit 1).
        raise ConfigError(
            f"tiers: tier {', '.join(twice)} configured twice (the built-in tiers are ram, "
            "disk with cache_dir, ram_file with shm_dir, s3 with s3_bucket; name another one)"
        )
    if tier not in names:
        raise ConfigError(f"save_tier {tier} is not a configured tier ({', '.join(names)})")
    # The cache's own checks (a tier URL's scheme, a tier's name, two tiers on one directory),
    # here, before the server binds. Found by review: ``--tiers x=foo://bar`` or a tier named
    # ``a b`` was refused only once the server had started, by the engine (exit status 1).
    try:
        validate_cache_config(cache_config(s))
    except ConfigError as exc:
        raise ConfigError(f"tiers: {exc}") from exc
    if s.s3_bucket is None:
        return
    if not s.s3_bucket.strip():
        raise ConfigError("s3_bucket must not be empty")
    if s.s3_prefix and not s.s3_prefix.endswith("/"):
        raise ConfigError(f"s3_prefix must end with '/', got {s.s3_prefix!r}")
