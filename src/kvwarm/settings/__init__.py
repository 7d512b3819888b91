"""Server and CLI settings: one pydantic-settings class, one loader.

Invariant: every setting is declared exactly once, as a field of ``Settings`` (or of the
``ModelSettings`` it extends, ``kvwarm.settings.model``: the ones a ``[[models]]`` table may
also set per model): its type, default and help text. Everything else is derived from that
field: the environment variable ``KVWARM_<NAME>``, the TOML key ``<name>`` (top level or under
``[kvwarm]``), the flag ``--<name-with-dashes>`` and its help. ``load_settings`` merges the
sources with the precedence flags > environment > config file > defaults, parsing each value
alone so that a bad one is a ``ConfigError`` naming its source and setting before anything
loads.

Adding a setting
----------------
1. Add a field to ``Settings``: ``name: Int = Field(default=8, description="help text")``
   (``default=`` by keyword, so mypy sees it). Use a parsing type of ``kvwarm.settings.types``
   (``Int``, ``Size``, ``Bool``, ``OptPath`` ...) so that the string forms (flags, env) parse
   like the others' (``Int`` reads "8", ``Size`` "2G"); add a type there if none fits.
2. Optional, through ``json_schema_extra``: ``{"flag": "--other-name"}`` for a flag name that
   differs from the field's, ``{"aliases": ["-x"]}`` for more spellings of the flag,
   ``{"repeatable": True}`` for a flag given several times, ``{"switch": True}`` for one
   without a value (``kvwarm.settings.flags``).
3. Cross-setting rules and range checks go in ``Settings.check`` (raise ``ConfigError``).
4. A CLI subcommand that needs it lists its name in ``kvwarm.cli.common`` (``serve`` gets all).
Nothing else: flag, env var, TOML key and help follow. ``tests/cli/test_settings.py`` shows how
to test one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvwarm.cache.eviction.base import registered_policies
from kvwarm.cache.types import CacheConfig, PolicyConfig, S3Config, TierName
from kvwarm.errors import ConfigError
from kvwarm.media import MediaLimits
from kvwarm.settings import cache as settings_cache
from kvwarm.settings.flags import add_arguments, env_name, field_extra, flag_name
from kvwarm.settings.model import (
    ModelSettings,
    ServingSettings,
    check_models,
    model_config,
    parse_field,
)
from kvwarm.settings.sources import (
    read_env,
    read_toml,
    unknown_env,
    user_cache_dir,
    user_config_file,
)
from kvwarm.settings.types import (
    Bool,
    Float,
    Int,
    Key,
    Models,
    ModelSpec,
    OptPath,
    OptStr,
    OptTier,
    Policy,
    Size,
    Str,
    StrTuple,
    policy_items,
)

__all__ = [
    "CLUSTER_ONLY",
    "CONFIG_ENV",
    "ENV_PREFIX",
    "SERVER_POLICY",
    "ModelSpec",
    "Settings",
    "add_settings_arguments",
    "default_text",
    "env_var",
    "load_settings",
    "model_config",
    "settings_flags",
    "settings_reference",
    "user_cache_dir",
    "user_config_file",
]

ENV_PREFIX = "KVWARM_"
CONFIG_ENV = "KVWARM_CONFIG"
_GIB = 1 << 30
#: What no origin or host name holds: a list separator, blanks, a user part.
_LIST_JUNK = re.compile(r"[,;\s@]")
#: The longest wait a thread can be told (``threading.TIMEOUT_MAX``, about 292 years).
MAX_SECONDS = threading.TIMEOUT_MAX


# erllama's gates (min_tokens 512, align 2048) suit big models on GPUs. A local CPU server
# pays ~0.3 s to prefill 64 tokens and ~1 ms to restore them, so every chat turn over 64
# tokens is worth a row; cold saves align to the default n_batch so their rows stay canonical.
SERVER_POLICY = PolicyConfig(
    min_tokens=64,
    cold_min_tokens=512,
    continued_interval=512,
    boundary_trim_tokens=32,
    boundary_align_tokens=512,
)

_REPEAT: dict[str, Any] = {"repeatable": True}
# Settings only ``kvwarm cluster`` takes as flags (the environment and TOML accept them always).
CLUSTER_ONLY = (
    "replicas",
    "ray_address",
    "node_ip",
    "cluster_routing",
    "cluster_busy_requests",
    "cluster_call_timeout_s",
    "cluster_save_wait_s",
)


class Settings(ModelSettings, ServingSettings):
    """Everything ``kvwarm serve`` and the CLI can be told. Constructing one directly uses only
    the given values and the defaults (no hidden environment reads); ``load_settings`` layers
    flags, environment and config file on top. The per-model settings (GPU, threads, KV types,
    RoPE) are declared in ``ModelSettings`` (``kvwarm.settings.model``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", validate_default=False
    )

    host: Str = Field(default="127.0.0.1", description="address to listen on")
    port: Int = Field(default=8000, description="port to listen on (0: any free port)")
    models: Models = Field(
        default=(ModelSpec(),),
        description="a model to serve, [ID=]PATH (repeatable; PATH 'default' = embedded; ID "
        "defaults to the file's stem; one id twice is an error)",
        json_schema_extra={"flag": "--model", **_REPEAT},
    )
    backend: Str = Field(default="llama_cpp", description="default backend: llama_cpp or stub")
    n_ctx: Int = Field(default=4096, description="context window per model")
    n_batch: Int = Field(default=512, description="prefill batch size (cache rows align to it)")
    # Concurrent requests share one context (continuous batching), as llama.cpp's server does.
    n_parallel: Int = Field(default=4, description="concurrent sequences (slots) per model")
    deterministic: Bool = Field(
        default=False,
        description="restores bit-identical to a cold prefill (slower)",
        json_schema_extra={"switch": True},
    )
    fingerprint_mode: Str = Field(
        default="safe", description="model fingerprint: safe, gguf_chunked or fast_unsafe"
    )
    # None disables the disk tier (RAM only; nothing survives a restart).
    cache_dir: OptPath = Field(
        default_factory=user_cache_dir,
        description="disk tier directory ('none' disables the disk tier)",
    )
    disk_quota_bytes: Size = Field(default=20 * _GIB, description="disk tier quota, e.g. 20G")
    ram_quota_bytes: Size = Field(default=1 * _GIB, description="RAM tier quota, e.g. 1G")
    shm_dir: OptPath = Field(
        default=None, description="ram_file tier directory, e.g. /dev/shm/kvwarm (default off)"
    )
    shm_quota_bytes: Size = Field(default=2 * _GIB, description="ram_file tier quota")
    # One memory budget (issue 25): the RAM tier gets what the models' weights and contexts
    # and the other in-memory tiers (ram_file: /dev/shm is memory) leave of it; a model that
    # does not fit is refused with the arithmetic (server/budget.py).
    memory_budget: Size = Field(
        default=0,
        description="bytes this server may use for weights, contexts and in-memory cache "
        "tiers, e.g. 8G; sizes the RAM tier to what is left (0: off, ram_quota_bytes applies)",
    )
    # A directory several hosts mount (NFS, CephFS): rows others publish are found at once,
    # hits are copied to a local tier, temp files are reaped by age only.
    cache_dir_shared: Bool = Field(
        default=False, description="cache_dir is shared by several hosts (NFS, CephFS)"
    )
    # The s3 tier (extra kvwarm[s3]); credentials come from boto3's chain (AWS_* env, profile).
    s3_bucket: OptStr = Field(
        default=None, description="bucket of the shared s3 tier (default off)"
    )
    s3_prefix: Str = Field(default="kvwarm/", description="object name prefix in the s3 bucket")
    s3_endpoint_url: OptStr = Field(
        default=None, description="S3-compatible endpoint, e.g. http://minio:9000 (default AWS)"
    )
    s3_region: OptStr = Field(default=None, description="s3 region (default: boto3's choice)")
    s3_quota_bytes: Size = Field(default=100 * _GIB, description="s3 tier quota, e.g. 100G")
    s3_connect_timeout_s: Float = Field(default=2.0, description="s3 connect timeout, seconds")
    s3_read_timeout_s: Float = Field(default=10.0, description="s3 read timeout, seconds")
    s3_max_attempts: Int = Field(
        default=2, description="s3 attempts per request, the first included"
    )
    s3_min_bytes_per_s: Size = Field(
        default=1 << 20,
        description="slowest s3 transfer kept, bytes a second: a GET or PUT moving less over "
        "s3_read_timeout_s is abandoned as a network fault (0: no floor)",
    )
    s3_packs: Bool = Field(
        default=True,
        description="a save's new chunks in one pack object; off: one object each, which a "
        "kvwarm from before packs reads (a rolling upgrade)",
    )
    # Any store by URL, after the tiers above: NAME=URL, the quota as the URL's quota=SIZE.
    tiers: StrTuple = Field(
        default=(),
        description="more tiers, each NAME=URL with ?quota=SIZE, e.g. "
        "shared=redis://10.0.0.5:6379/0?quota=8G (file://, s3://, ram://, redis://; "
        "repeatable)",
        json_schema_extra=_REPEAT,
    )
    save_tier: OptTier = Field(
        default=None,
        description="tier new rows are written to (default: s3 if a bucket is set, else disk "
        "if enabled)",
    )
    # Off: row files hold tokens and KV, not the prompt's words (a user's text at rest).
    store_prompt_text: Bool = Field(
        default=False, description="also write each row's prompt text into its file"
    )
    cache_eviction: Str = Field(
        default="lru", description="which cache rows go first when a tier is full: lru or lfu"
    )
    cache_chunk_tokens: Int = Field(
        default=256,
        description="rows are stored as shared chunks of this many tokens (a divisor or a "
        "multiple of n_batch; 0: one whole blob a row)",
    )
    cache_state_history: Int = Field(
        default=2,
        description="a recurrent or hybrid model's saved states kept per conversation below "
        "its newest, besides those other conversations share (-1: every one)",
    )
    policy: Policy = Field(
        default=SERVER_POLICY,
        description="cache policy override KEY=VALUE (repeatable), e.g. min_tokens=64",
        json_schema_extra={"env": ENV_PREFIX + "POLICY_<KEY>", **_REPEAT},
    )
    max_body_bytes: Size = Field(default=8 << 20, description="largest accepted request body")
    default_max_tokens: Int = Field(default=512, description="max_tokens when a request gives none")
    # One request must not hold a slot for a whole window: a request asking for more is served
    # up to the limit (as llama-server's -n caps n_predict; the reply then ends as at its own
    # max_tokens) or, with max_tokens_over_limit = "refuse", a 400.
    max_tokens_limit: Int = Field(
        default=4096, description="largest max_tokens a request is served (more: capped or 400)"
    )
    max_tokens_over_limit: Str = Field(
        default="cap",
        description="a request asking for more than max_tokens_limit: cap (served up to the "
        "limit) or refuse (400)",
    )
    keepalive_interval_s: Float = Field(
        default=60.0, description="seconds between keep-alive re-warms (0: off)"
    )
    keepalive_stale_fraction: Float = Field(
        default=0.8, description="re-warm a prewarmed prefix at this share of TTL"
    )
    # Each kept prefix costs a background prefill per TTL period, so what is kept is bounded.
    keepalive_max_entries: Int = Field(
        default=16, description="most prefixes kept warm at once (more: 409)"
    )
    keepalive_max_tokens: Int = Field(
        default=16384, description="most tokens kept warm in all (more: 409)"
    )
    keepalive_max_age_s: Float = Field(
        default=86400.0,
        description="drop a kept prefix this many seconds after its last prewarm (0: never)",
    )
    prewarm_system: StrTuple = Field(
        default=(),
        description="system prompt to prewarm at startup (repeatable)",
        json_schema_extra=_REPEAT,
    )
    api_key: Key = Field(
        default=None,
        description="require this key on every API request (Authorization: Bearer, or x-api-key)",
    )
    request_timeout_s: Float = Field(
        default=600.0,
        description="end any generation, rerank or embedding still running after this many "
        "seconds with a request_timeout error (0: no deadline)",
    )
    worker_stall_s: Float = Field(
        default=30.0,
        description="/health is degraded, naming the model, when its worker has not ticked "
        "for this many seconds (0: never)",
    )
    admin_key: Key = Field(
        default=None,
        description="bearer token required on admin endpoints (/cache/*, /admin/*, /cluster, "
        "POST /lora-adapters, POST /props); default: none",
    )
    # Tenants (server/tenancy.py): each key presented gets its own cache namespace.
    cache_salt_from_auth: Bool = Field(
        default=False,
        description="derive a cache salt from the bearer token, so each API key is a tenant",
    )
    # /docs (server/apidocs.py) runs Swagger UI's script from a CDN, and keys are typed there.
    api_docs: Bool = Field(
        default=True,
        description="serve the Swagger UI page at /docs (its script comes from a CDN); "
        "--no-api-docs: none (/openapi.json stays)",
        json_schema_extra={"negatable": True},
    )
    # Browser defence (server/guard.py): a page elsewhere must not drive a local server.
    allowed_origins: StrTuple = Field(
        default=(),
        description="extra browser origin allowed to call the API, e.g. http://app:3000 "
        "(repeatable; '*' any)",
        json_schema_extra={"flag": "--allowed-origin", **_REPEAT},
    )
    allowed_hosts: StrTuple = Field(
        default=(),
        description="extra Host header name accepted besides loopback and the bound address "
        "(repeatable; '*' any)",
        json_schema_extra={"flag": "--allowed-host", **_REPEAT},
    )
    # Images and audio in chat messages (models with an mmproj): decoded in Python under these
    # limits before anything reaches llama.cpp (kvwarm.media).
    media_max_bytes: Size = Field(
        default=8 << 20,
        description="largest image or audio file in a request, encoded (max_body_bytes also "
        "bounds the request, where base64 takes 4/3 of it)",
    )
    media_max_pixels: Int = Field(
        default=16 << 20,
        description="most pixels (width x height) of one image, read from its header before "
        "it is decoded",
    )
    media_max_items: Int = Field(default=8, description="most images and audio clips per request")
    media_max_request_bytes: Size = Field(
        default=256 << 20,
        description="most bytes one request's images and audio clips take decoded, together "
        "(3 per pixel, 4 per sample); an item past it is refused before it is decoded",
    )
    media_max_audio_s: Float = Field(default=300.0, description="longest audio clip, seconds")
    media_formats: StrTuple = Field(
        default=("png", "jpeg", "webp", "gif", "bmp", "wav"),
        description="image and audio formats accepted (png, jpeg, webp, gif, bmp, wav)",
        json_schema_extra={"flag": "--media-format", **_REPEAT},
    )
    # A local server must not fetch whatever URL a web page puts in a request.
    media_fetch_hosts: StrTuple = Field(
        default=(),
        description="host an image_url may be fetched from over http(s), on ports 80/443 or "
        "the one named (host:port); '*': any host whose addresses are all public (repeatable; "
        "none: only data: URIs)",
        json_schema_extra={"flag": "--media-fetch-host", **_REPEAT},
    )
    max_json_depth: Int = Field(
        default=64, description="deepest nesting of arrays/objects accepted in a request body"
    )
    # What one request may ask of a model (issue 41): counted on the parsed body, before
    # anything is built per item; OpenAI's embeddings limit is 2,048 inputs.
    max_embedding_inputs: Int = Field(
        default=2048, description="most inputs one /v1/embeddings request may embed (more: 400)"
    )
    max_completion_prompts: Int = Field(
        default=2048, description="most prompts one /v1/completions request may hold (more: 400)"
    )
    max_chat_messages: Int = Field(
        default=2048,
        description="most messages (input items) one chat request may hold, a Responses "
        "follow-up's with the conversation it continues (more: 400)",
    )
    # Slow clients (server/http.py): uvicorn starts no timer before a request's first response
    # byte, so a client sending half a header held its connection (and a file descriptor) for
    # ever.
    header_timeout_s: Float = Field(
        default=10.0,
        description="seconds a client has to send a request's headers, from connecting or "
        "from its previous response; then a 408 and the connection is closed (0: no limit)",
    )
    body_timeout_s: Float = Field(
        default=30.0,
        description="seconds a client has to send a request's whole body once its headers "
        "are in; then the connection is closed (0: no limit)",
    )
    # A client that stopped reading held its connection, its reply and its model's lease for
    # ever: uvicorn waits on a full send buffer with no timer (server/connections.py).
    send_timeout_s: Float = Field(
        default=60.0,
        description="seconds a response may wait with none of it taken by its client (the "
        "connection's send buffers full); then the connection is closed and its generation "
        "cancelled (0: no limit)",
    )
    max_connections: Int = Field(
        default=1000,
        description="open HTTP connections at most; more are answered 503 and closed (also "
        "kept below the open-file limit)",
    )
    log_level: Str = Field(
        default="info", description="logging level: debug, info, warning, error, critical"
    )
    # `kvwarm cluster` only (kvwarm.cluster; not flags of the other commands: CLUSTER_ONLY).
    replicas: Int = Field(default=2, description="cluster: engine replicas to run")
    ray_address: OptStr = Field(
        default=None,
        description="cluster: the Ray cluster to join, HOST:PORT of its head (`ray start "
        "--head --port PORT`) or ray://HOST:10001 (default: start a local one)",
        json_schema_extra={"aliases": ["--address"]},
    )
    node_ip: OptStr = Field(
        default=None,
        description="cluster: the address a local Ray listens on and other nodes reach it at; "
        "opens its services (GCS, raylet, agents) to that network (default: 127.0.0.1 only)",
    )
    cluster_routing: Str = Field(
        default="events",
        description="cluster: the routing policy that ranks replicas for a request, by name "
        "(events: by what each replica's cache could serve of it, from their cache events, "
        "against load; prefix: by the conversation text each replica served)",
    )
    cluster_busy_requests: Int = Field(
        default=0,
        description="cluster: requests in flight at which a replica counts as busy and a "
        "conversation moves on (0: 2 x n_parallel)",
    )
    cluster_call_timeout_s: Float = Field(
        default=30.0,
        description="cluster: seconds the ingress waits for a replica's answer to a call that "
        "is not a generation and runs no model pass (tokenize, detokenize, chat template, "
        "token counts, model info); embeddings, rerank and prewarms take request_timeout_s. "
        "Past it the call is cancelled on its replica and answered 504 replica_timeout "
        "(0: no deadline)",
    )
    cluster_save_wait_s: Float = Field(
        default=5.0,
        description="cluster: how long a replica waits for a reply's finish save to reach a "
        "tier other replicas read (a shared or node directory, s3, redis) before the reply "
        "ends (a non-streamed response, a stream's last event), so that a replica dying "
        "after answering leaves the turn restorable elsewhere; 0: do not wait",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only the constructor's values: the layering (and its error messages) is load_settings's.
        return (init_settings,)

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied and validated (``Settings`` is frozen)."""
        return type(self)(**{**dict(self), **changes})

    def effective_save_tier(self) -> TierName:
        return settings_cache.save_tier(self)

    def s3_config(self) -> S3Config | None:
        return settings_cache.s3_config(self)

    def cache_config(self) -> CacheConfig:
        return settings_cache.cache_config(self)

    def media_limits(self) -> MediaLimits:
        return MediaLimits(
            max_bytes=self.media_max_bytes,
            max_pixels=self.media_max_pixels,
            max_audio_s=self.media_max_audio_s,
            max_items=self.media_max_items,
            max_request_bytes=self.media_max_request_bytes,
            formats=tuple(f.lower() for f in self.media_formats),
        )

    def media_fetch_rules(self) -> tuple[tuple[str, int | None], ...]:
        """``media_fetch_hosts`` as (host, port or None for 80/443) pairs, the host lower-cased
        without IPv6 brackets (``*``: any public host); raises ``ConfigError`` for an entry
        that is not ``host``, ``host:port``, ``[ipv6]``, ``[ipv6]:port`` or ``*``."""
        rules: list[tuple[str, int | None]] = []
        for entry in self.media_fetch_hosts:
            value = entry.strip().lower()
            host, port = value, ""
            if value.startswith("["):
                host, _, rest = value[1:].partition("]")
                if rest and not rest.startswith(":"):
                    host = ""
                port = rest[1:]
            elif value.count(":") == 1:
                host, _, port = value.partition(":")
            if (
                not host
                or "/" in host
                or _LIST_JUNK.search(host)
                or (port and not (port.isdigit() and 0 < int(port) < 65536))
                or (value.startswith("[") and not value[1:].partition("]")[1])
            ):
                raise ConfigError(
                    f"media_fetch_hosts: {entry!r} is not a host, host:port, [ipv6]:port or '*'"
                )
            rules.append((host, int(port) if port else None))
        return tuple(rules)

    def _check_browser_lists(self) -> None:
        """``allowed_origins`` and ``allowed_hosts``: each entry one origin (``scheme://host
        [:port]``) or one Host name (``name[:port]``), or ``*``. Found by review: these are
        lists, one entry a flag, and ``KVWARM_ALLOWED_ORIGINS=http://a:3000,http://b:3000``
        was one origin that no browser sends, so both pages were refused with no word at
        start-up (likewise a URL given as a host)."""
        for entry in self.allowed_origins:
            scheme, sep, rest = entry.strip().partition("://")
            if entry == "*":
                continue
            if (
                _LIST_JUNK.search(entry)
                or not sep
                or not scheme
                or not rest.rstrip("/")
                or ("/" in rest.rstrip("/"))
            ):
                raise ConfigError(
                    f"allowed_origins: {entry!r} is not an origin (scheme://host[:port], or *); "
                    "give each origin as its own --allowed-origin"
                )
        for entry in self.allowed_hosts:
            if entry != "*" and (not entry.strip() or _LIST_JUNK.search(entry) or "/" in entry):
                raise ConfigError(
                    f"allowed_hosts: {entry!r} is not a host name (name[:port], or *); give "
                    "each host as its own --allowed-host"
                )

    def check(self) -> None:
        """Range and cross-setting rules; raises ``ConfigError``."""
        for field_name in type(self).model_fields:
            value = getattr(self, field_name)
            # NaN passes every "< 0" check (a busy loop where it is a wait's seconds) and inf
            # overflows where a wait is converted: a number setting must be finite.
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{field_name} must be finite, got {value}")
            # Found by review: keepalive_interval_s = 1e10 passed, and the keep-alive thread
            # died at once of Event.wait's OverflowError (the keep-alive silently off).
            if field_name.endswith("_s") and isinstance(value, float) and value > MAX_SECONDS:
                raise ConfigError(f"{field_name} must be at most {MAX_SECONDS:.0f}, got {value:g}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"log_level must be one of debug, info, warning, error, critical; "
                f"got {self.log_level!r}"
            )
        if not self.host.strip():
            # Found by review: uvicorn binds "" to every interface, as 0.0.0.0 says openly.
            raise ConfigError("host is empty; give an address (0.0.0.0: every interface)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("n_ctx", "n_batch", "n_parallel", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.default_max_tokens < 0:
            raise ConfigError("default_max_tokens must be >= 0")
        if self.max_tokens_limit < max(1, self.default_max_tokens):
            raise ConfigError("max_tokens_limit must be >= 1 and >= default_max_tokens")
        if self.max_tokens_over_limit not in ("cap", "refuse"):
            raise ConfigError(
                f"max_tokens_over_limit must be cap or refuse, got {self.max_tokens_over_limit!r}"
            )
        # Durations: 0 turns the timeouts off; a negative value must not do so silently.
        for name in (
            "keepalive_interval_s", "keepalive_max_age_s", "request_timeout_s", "worker_stall_s"
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if not 0.0 < self.keepalive_stale_fraction <= 1.0:
            raise ConfigError("keepalive_stale_fraction must be in (0, 1]")
        if self.keepalive_max_entries < 0 or self.keepalive_max_tokens < 0:
            raise ConfigError("keepalive_max_entries and keepalive_max_tokens must be >= 0")
        if self.replicas < 1 or self.cluster_busy_requests < 0:
            raise ConfigError("replicas must be >= 1 and cluster_busy_requests >= 0")
        for name in ("cluster_save_wait_s", "cluster_call_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.max_json_depth < 2:
            raise ConfigError("max_json_depth must be >= 2")
        for name in (
            "max_embedding_inputs", "max_completion_prompts", "max_chat_messages",
            "max_connections",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.fingerprint_mode not in ("safe", "gguf_chunked", "fast_unsafe"):
            raise ConfigError("fingerprint_mode must be safe, gguf_chunked or fast_unsafe")
        if self.cache_eviction not in registered_policies():
            known = ", ".join(registered_policies())
            raise ConfigError(f"cache_eviction must be one of {known}, got {self.cache_eviction!r}")
        self.media_fetch_rules()
        self._check_browser_lists()
        settings_cache.check(self)
        check_models(self)  # the model list, aliases and every model's parameters


# --- derived from the fields: flags, env, TOML keys ---------------------------------------------


def _flag(name: str) -> str:
    return flag_name(Settings, name)


def env_var(name: str) -> str:
    return env_name(Settings, name, ENV_PREFIX)


def add_settings_arguments(parser: argparse.ArgumentParser, names: Sequence[str] = ()) -> None:
    """Add the flags of ``names`` (all settings but ``CLUSTER_ONLY`` if empty), those of
    ``ModelSettings`` in a ``--help`` group of their own (``kvwarm.settings.flags``)."""
    names = names or [n for n in Settings.model_fields if n not in CLUSTER_ONLY]
    add_arguments(
        parser,
        Settings,
        names,
        per_model=ModelSettings,
        env_prefix=ENV_PREFIX,
        config_env=CONFIG_ENV,
        default=default_text,
    )


@functools.cache
def _flag_variables() -> dict[str, str]:
    """``KVWARM_`` + a long flag's name, where it is not the setting's variable: that
    variable (``KVWARM_CACHE_TYPE_K``: ``KVWARM_TYPE_K``). Found by review: such a variable,
    spelled after the flag the docs lead with, was only logged as ignored."""
    out: dict[str, str] = {}
    for name in Settings.model_fields:
        for flag in (_flag(name), *field_extra(Settings, name).get("aliases", ())):
            var = ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
            if flag.startswith("--") and var != env_var(name):
                out[var] = env_var(name)
    return out


def settings_flags(namespace: argparse.Namespace) -> dict[str, object]:
    """The settings given on the command line, as raw values for ``load_settings``."""
    return {k: v for k, v in vars(namespace).items() if k in Settings.model_fields or k == "config"}


def _parse(name: str, value: object, source: str) -> object:
    label = f"{source} setting {_flag(name) if source == 'flag' else name}"
    if name == "policy":
        try:
            return policy_items(value)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{label}: {exc}") from exc
    return parse_field(Settings, name, value, label)


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    base: Settings | None = None,
) -> Settings:
    """Merge flags > environment > config file > ``base`` (default: ``Settings()``).

    The config file is ``flags['config']``, else ``$KVWARM_CONFIG``, else the user config file
    if it exists. Policy values merge key by key across sources.
    """
    flags = dict(flags or {})
    env = os.environ if env is None else env
    known = {env_var(name) for name in Settings.model_fields} | {CONFIG_ENV}
    unknown_env(env, known, ENV_PREFIX, _flag_variables())
    explicit = flags.pop("config", None)
    where = "--config"
    if explicit is None:
        explicit, where = env.get(CONFIG_ENV), CONFIG_ENV
    if explicit is not None and not str(explicit).strip():
        # Found by review: an empty --config or KVWARM_CONFIG read as not given, and the
        # user's config file (if any) was read instead of the one meant.
        raise ConfigError(f"{where} is empty; give the config file's path")
    file_values: dict[str, object] = {}
    config_file: Path | None = None
    if explicit:
        config_file = Path(os.path.expanduser(str(explicit)))
    elif (default_file := user_config_file(env)).is_file():
        config_file = default_file
    if config_file is not None:
        file_values = read_toml(config_file, set(Settings.model_fields))
    defaults = base or Settings(cache_dir=user_cache_dir(env))
    values: dict[str, object] = {}
    policy: dict[str, int] = {}
    origin: dict[str, str] = {}  # where each given setting's value came from, the last source
    sources = (
        ("config file", file_values),
        ("environment", read_env(env, Settings, ENV_PREFIX)),
        ("flag", flags),
    )
    for source, raw in sources:
        for name, value in raw.items():
            # The file by its path (found by review: "config file setting n_ctx: expected an
            # integer" left the user to find which file: the default one, $KVWARM_CONFIG's).
            where = f"config file {config_file}" if source == "config file" else source
            parsed = _parse(name, value, where)
            if source == "config file":
                origin[name] = f"config file {config_file}"
            elif source == "environment":
                origin[name] = env_var(name)
            else:
                origin[name] = _flag(name)
            if name == "policy":
                assert isinstance(parsed, dict)
                policy.update(parsed)
            else:
                values[name] = parsed
    if policy:
        values["policy"] = dataclasses.replace(defaults.policy, **policy)
    if values.get("models_dir") is not None and "models" not in values:
        # A models directory given alone serves that directory, not also the default model.
        values["models"] = ()
    settings = defaults.replace(**values)
    try:
        settings.check()
        _check_given(settings, origin)
    except ConfigError as exc:
        raise _with_origin(exc, origin) from exc
    return settings


#: Settings that do nothing unless another is set: (settings, what turns them on, the check).
_NEEDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        ("disk_quota_bytes", "cache_dir_shared"),
        "cache_dir",
        "the disk tier is off (cache_dir none)",
    ),
    (("shm_quota_bytes",), "shm_dir", "the ram_file tier is off (no shm_dir)"),
    (
        (
            "s3_prefix", "s3_endpoint_url", "s3_region", "s3_quota_bytes",
            "s3_connect_timeout_s", "s3_read_timeout_s", "s3_max_attempts", "s3_packs",
            "s3_min_bytes_per_s",
        ),
        "s3_bucket",
        "the s3 tier is off (no s3_bucket)",
    ),
)  # fmt: skip


def _check_given(settings: Settings, given: Mapping[str, str]) -> None:
    """``ConfigError`` for a setting given (from any source) that the others make do
    nothing. Found by review: ``cache_dir_shared`` with the disk tier off, ``shm_quota_bytes``
    with no ``shm_dir``, an s3 endpoint with no bucket, and ``ram_quota_bytes`` beside a
    ``memory_budget`` (which sizes the RAM tier itself) were all taken and ignored."""
    for names, needed, why in _NEEDS:
        if getattr(settings, needed) is not None:
            continue
        for name in names:
            if name in given:
                raise ConfigError(f"{name} has no effect: {why}; set {needed}, or drop {name}")
    if settings.memory_budget and "ram_quota_bytes" in given:
        raise ConfigError(
            "ram_quota_bytes has no effect with memory_budget, which sizes the RAM tier to "
            "what the models and the other tiers leave of it; drop one of them"
        )


def _with_origin(exc: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """``exc`` with where the settings it names were given: a range or cross-setting rule
    (``Settings.check``) is broken by values that may come from any source. Found by review:
    "n_ctx must be >= 1" named no source, so a wrong value in a config file, the environment
    or a flag had to be hunted down."""
    message = str(exc)
    named = [
        f"{name} from {where}"
        for name, where in origin.items()
        if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", message)
    ]
    if not named or type(exc) is not ConfigError:
        return exc
    return ConfigError(f"{message} ({'; '.join(named)})")


# --- the reference table of docs/configuration.md -----------------------------------------------


def default_text(name: str) -> str:
    """The default of setting ``name`` as ``--help`` and docs/configuration.md show it."""
    field = Settings.model_fields[name]
    if name == "models":
        return "the embedded model"
    if name == "log_level":  # kvwarm.cli.common: the one-shot commands are quiet
        return "info for serve and cluster, warning for the other commands"
    if name == "cache_dir":
        return "$XDG_CACHE_HOME/kvwarm, else ~/.cache/kvwarm"
    if name == "spec_type":  # ModelConfig.default_spec_type
        return "none; draft-simple with a draft_model"
    if name == "policy":
        changed = [
            f"{f.name}={getattr(SERVER_POLICY, f.name)}"
            for f in dataclasses.fields(PolicyConfig)
            if getattr(SERVER_POLICY, f.name) != getattr(PolicyConfig(), f.name)
        ]
        return ", ".join(changed) + " (cache.md)"
    value = field.default
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and _is_size(name) and value:
        for suffix, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value % scale == 0:
                return f"{value // scale}{suffix}"
    return str(value)


def _is_size(name: str) -> bool:
    from kvwarm.settings.types import as_size

    return any(getattr(m, "func", None) is as_size for m in Settings.model_fields[name].metadata)


def settings_reference() -> str:
    """Every setting as a Markdown table: its TOML key, flag, default and description; the
    section "Every setting" of docs/configuration.md is this text (``tests/cli``)."""
    rows = [
        "| Setting (TOML key) | Flag | Default | What it does |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        flags = [_flag(name), *field_extra(Settings, name).get("aliases", ())]
        if name == "api_docs":
            flags.append("--no-api-docs")
        where = " (per model)" if name in ModelSettings.model_fields else ""
        what = (field.description or "").replace("|", "\\|")
        cluster = " (`kvwarm cluster` only)" if name in CLUSTER_ONLY else ""
        rows.append(
            f"| `{name}`{where} | {', '.join(f'`{f}`' for f in flags)}{cluster} | "
            f"{default_text(name)} | {what} |"
        )
    return "\n".join(rows) + "\n"
