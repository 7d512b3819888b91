"""Tiers by name or by URL scheme: how a ``TierConfig`` becomes a ``Tier``.

Invariant: the facade and the config validation learn what tiers exist only from this
registry. A tier configured with a ``url`` is built by the factory registered for the URL's
scheme (``register_scheme``): ``file``, ``ram``, ``s3`` and ``redis`` below, so a new store is
one module (usually an ``ObjectStore`` under ``tiers/objects.py``'s generic tier) plus one
``register_scheme`` call, with no edit to the facade, the index, the validation or the
settings. A tier configured without a url is built by its name (``register_tier``): the
built-in spellings ``ram``, ``ram_file``, ``disk`` and ``s3``. Store clients (boto3, redis)
are imported only when a tier is built. See docs/architecture.md.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from kvwarm.cache.protocols import Tier
from kvwarm.cache.types import TierConfig
from kvwarm.errors import ConfigError

__all__ = [
    "TierOptions",
    "TierSpec",
    "build_tier",
    "check_name",
    "check_url",
    "register_scheme",
    "register_tier",
    "registered_schemes",
    "registered_tiers",
    "shown_url",
    "url_scheme",
    "url_switch",
    "tier_spec",
    "unregister_tier",
]


@dataclass(frozen=True, slots=True)
class TierOptions:
    """How the cache opens its tiers: ``repair=False`` means a scan moves and deletes nothing
    (``kvwarm cache verify``); ``maintenance``, a process that writes no row (``kvwarm cache
    gc``, ``verify --repair``): a file tier registers as such, so the processes writing the
    directory do not count it as a co-tenant (``cotenants.py``)."""

    repair: bool = True
    maintenance: bool = False


TierFactory = Callable[[TierConfig, TierOptions], Tier]


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    factory: TierFactory
    needs_root: bool  # the TierConfig must name a root directory (and must not otherwise)


_lock = threading.Lock()
_specs: dict[str, TierSpec] = {}
_schemes: dict[str, TierFactory] = {}


def register_tier(name: str, factory: TierFactory, *, needs_root: bool) -> None:
    """Make ``name`` configurable. Registering a name twice replaces the earlier factory
    (tests, or a deployment overriding a built-in)."""
    check_name(name)
    with _lock:
        _specs[name] = TierSpec(name, factory, needs_root)


def unregister_tier(name: str) -> None:
    with _lock:
        _specs.pop(name, None)


def tier_spec(name: str) -> TierSpec:
    spec = _specs.get(name)
    if spec is None:
        known = ", ".join(registered_tiers())
        raise ConfigError(f"unknown tier {name!r}; expected one of {known}")
    return spec


def registered_tiers() -> tuple[str, ...]:
    with _lock:
        return tuple(_specs)


TierCheck = Callable[[TierConfig], None]
_checks: dict[str, TierCheck] = {}


def register_scheme(scheme: str, factory: TierFactory, check: TierCheck | None = None) -> None:
    """Make tiers configurable by URLs of ``scheme`` (``redis`` for ``redis://...``).
    ``check``: what ``factory`` would refuse of a URL (its options), raised as a
    ``ConfigError`` without opening anything, so configuration checks it before a server
    starts (``check_url``)."""
    if not scheme or not scheme.replace("+", "").isalnum():
        raise ConfigError(f"URL schemes are [A-Za-z0-9+]+: {scheme!r}")
    with _lock:
        _schemes[scheme.lower()] = factory
        if check is None:
            _checks.pop(scheme.lower(), None)
        else:
            _checks[scheme.lower()] = check


def check_url(config: TierConfig) -> None:
    """``ConfigError`` for a URL tier's unknown scheme or, where its scheme registered a
    check, a URL its factory would refuse. Found by review: ``?quotaa=1G`` or a relative
    ``file://`` path was refused only when the tiers were built, after the server started."""
    assert config.url is not None
    check = _checks.get(url_scheme(config.url))
    if check is not None:
        check(config)


def registered_schemes() -> tuple[str, ...]:
    with _lock:
        return tuple(_schemes)


#: URL options whose values are secrets: redis-py takes ``?password=`` as the password.
_SECRET_OPTION = re.compile(r"password|secret|token|key", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` as messages and logs may show it: a password in it is masked, in its user
    part or as an option (found by review: ``redis://host/0?password=...``, which redis-py
    takes, was shown whole in every error about the URL)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urlsplit can read (a bad port...): show no part of it
        return "<unreadable URL>"
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(_SECRET_OPTION.search(k) for k, _ in query):
        masked = [(k, "***" if _SECRET_OPTION.search(k) else v) for k, v in query]
        parts = parts._replace(query=urlencode(masked, safe="*"))
    if password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    return parts.geturl()


def url_scheme(url: str) -> str:
    """The registered scheme of ``url``; ``ConfigError`` if none is."""
    scheme = urlsplit(url).scheme.lower()
    with _lock:
        known = scheme in _schemes
    if not known:
        names = ", ".join(f"{s}://" for s in registered_schemes())
        raise ConfigError(f"tier URL {shown_url(url)!r}: unknown scheme; expected one of {names}")
    return scheme


def build_tier(config: TierConfig, options: TierOptions) -> Tier:
    if config.url is not None:
        return _schemes[url_scheme(config.url)](config, options)
    return tier_spec(config.name).factory(config, options)


def check_name(name: str) -> None:
    # ASCII only: str.isalnum() takes "disqué" or "²", which /metrics's tier pattern does not
    # match, so such a tier's sizes were exposed as counters of a mangled name, unlabelled.
    if not name or not name.isascii() or not name.replace("_", "").isalnum():
        raise ConfigError(f"tier names are [A-Za-z0-9_]+ (they appear in metric names): {name!r}")


def _ram(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.ram import RamTier

    return RamTier(config.quota_bytes, name=config.name)


def _file(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.files import FileTier

    assert config.root is not None  # validated: the spec needs a root
    return FileTier(
        config.name,
        config.root,
        config.quota_bytes,
        repair=options.repair,
        shared_dir=config.shared,
        maintenance=options.maintenance,
    )


def _s3(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.s3 import S3Tier

    if config.s3 is None:
        raise ConfigError(f"tier {config.name} needs an s3 configuration (bucket, endpoint...)")
    return S3Tier(config.s3, config.quota_bytes, name=config.name, repair=options.repair)


def _query(url: str, name: str, known: tuple[str, ...] = ()) -> dict[str, str]:
    """The URL's options, ``ConfigError`` for one not in ``known`` (found by review: a file
    tier's ``?shraed=1`` was ignored, and a directory several hosts share opened as one
    process's own, as the s3 store's URL already refused)."""
    query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    unknown = sorted(set(query) - set(known))
    if unknown:
        takes = f"takes only {', '.join(known)}" if known else "takes none"
        raise ConfigError(
            f"tier {name}: unknown URL option {unknown[0]!r} ({urlsplit(url).scheme}:// {takes}; "
            "the quota is given as ?quota=SIZE in the setting, or TierConfig.quota_bytes)"
        )
    return query


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def url_switch(query: Mapping[str, str], option: str, where: str, *, default: bool) -> bool:
    """A URL's on/off option (1/0, true/false, yes/no, on/off), ``default`` when absent;
    ``ConfigError`` naming ``where`` for any other value."""
    if option not in query:
        return default
    value = query[option].lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{where}: {option}={query[option]!r}: expected 1 or 0 (true/false)")
    return value in _TRUE


def _file_url_parts(config: TierConfig) -> tuple[Path, bool]:
    """A file URL's root directory and ``shared`` option; ``ConfigError`` for anything else."""
    assert config.url is not None
    parts = urlsplit(config.url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ConfigError(f"tier {config.name}: a file URL names an absolute local path")
    query = _query(config.url, config.name, ("shared",))
    shared = url_switch(query, "shared", f"tier {config.name}", default=False)
    return Path(unquote(parts.path)), shared


def _file_url(config: TierConfig, options: TierOptions) -> Tier:
    """``file:///abs/path[?shared=1]``: a directory of crash-safe row files."""
    from kvwarm.cache.tiers.files import FileTier

    root, shared = _file_url_parts(config)
    return FileTier(
        config.name,
        root,
        config.quota_bytes,
        repair=options.repair,
        shared_dir=shared,
        maintenance=options.maintenance,
    )


def _ram_url_check(config: TierConfig) -> None:
    assert config.url is not None
    _query(config.url, config.name)


def _ram_url(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.ram import RamTier

    _ram_url_check(config)
    return RamTier(config.quota_bytes, name=config.name)


def _s3_url(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.s3 import S3Tier, s3_config_from_url

    assert config.url is not None
    cfg = s3_config_from_url(config.url)
    return S3Tier(cfg, config.quota_bytes, name=config.name, repair=options.repair)


def _redis_url(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.objects import ObjectTier, remote_capabilities
    from kvwarm.cache.tiers.redis import RedisStore

    assert config.url is not None
    store = RedisStore(config.url)
    return ObjectTier(
        store,
        config.quota_bytes,
        name=config.name,
        repair=options.repair,
        capabilities=remote_capabilities(packs=store.packs),
    )


def _s3_url_check(config: TierConfig) -> None:
    from kvwarm.cache.tiers.s3 import s3_config_from_url

    assert config.url is not None
    s3_config_from_url(config.url)


def _file_url_check(config: TierConfig) -> None:
    _file_url_parts(config)


register_scheme("file", _file_url, _file_url_check)
register_scheme("ram", _ram_url, _ram_url_check)
register_scheme("s3", _s3_url, _s3_url_check)
register_scheme("redis", _redis_url)
register_scheme("rediss", _redis_url)
register_tier("ram", _ram, needs_root=False)
register_tier("ram_file", _file, needs_root=True)
register_tier("disk", _file, needs_root=True)
register_tier("s3", _s3, needs_root=False)
