"""Value types shared by the cache's parts and its callers. Pure data; no I/O.

Invariant: a cache row never carries a sequence id, a model handle or a path that its key
depends on. A row is addressed by its key alone; ``Namespace`` + tokens derive the key.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# A tier is named by the string it was registered under (``tiers.registry``); the set is open.
TierName = str
# Cuts a KV blob into one payload per token range ``[bounds[i], bounds[i+1])`` (a backend's
# ``kv_split``): how the cache turns a saved blob into chunks without knowing its layout.
Splitter = Callable[[bytes | bytearray | memoryview, Sequence[int]], list[bytes]]
# The part of a blob after the KV cache a ``Splitter`` cuts (a backend's ``kv_codec.rest``:
# an iSWA model's window, a hybrid model's recurrent state): a manifest keeps it whole.
Rester = Callable[[bytes | bytearray | memoryview], bytes | bytearray | memoryview]
# The positions ``(first, end)`` a blob's rest holds when it is a KV cache of cells that a
# ``Splitter`` for the rest can cut (a backend's ``kv_codec.rest_span``: an iSWA window).
RestSpan = Callable[[bytes | bytearray | memoryview], tuple[int, int]]
# Packs a sequence's positions from ``start`` on (a backend's ``kv_pack_tail``): ``(blob,
# first)``, ``first`` being ``start`` or 0 where the backend packed the whole sequence.
Packer = Callable[[int], tuple[bytes, int]]
# The per-tier levels the cache reports, as ``tier_<name>_<series>`` (``Cache.counters``).
TIER_SERIES: tuple[str, ...] = (
    "bytes",
    "logical_bytes",
    "dedup_ratio",
    "chunks",
    "rows",
    "quota_bytes",
    "effective_quota_bytes",
    "quota_capped_by_filesystem",
)
# The per-tier running totals the cache reports, as ``tier_<name>_<series>``: the rows each
# tier restored into a request's slot (``CacheApi.record_restore``), the bytes read for them
# and the seconds they took, from opening the row to its KV in the slot.
TIER_TOTALS: tuple[str, ...] = ("restores", "restored_bytes", "restore_seconds")


# The per-memory-kind levels the cache reports, as ``memory_<kind>_<series>`` (``kind`` one of
# ``kvwarm.memory``'s, or "unknown" for rows that do not say): what the rows of models of that
# kind store (``bytes``: their own files and each chunk they name once) and restore
# (``logical_bytes``), so a user sees what deduplication saves on their model.
MEMORY_SERIES: tuple[str, ...] = ("bytes", "logical_bytes", "dedup_ratio", "chunks", "rows")


class SaveReason(enum.IntEnum):
    """Why a row was written; stored in the KVC header byte."""

    COLD = 0  # after a cold prefill, at the trimmed aligned boundary (async)
    CONTINUED = 1  # every continued_interval generated tokens (async)
    FINISH = 2  # prompt + reply at the end of a completion, with final logits (async)
    EVICT = 3  # a holder releases its live KV state (sync, bounded)
    SHUTDOWN = 4  # unload / process stop (sync, bounded)
    PREWARM = 5  # an explicit prewarm of a prefix, e.g. a system prompt (async)


class TtlClass(enum.IntEnum):
    """How long a row may live unused before the TTL sweep removes it."""

    SHORT = 0
    LONG = 1
    EXTENDED = 2


class FingerprintMode(enum.IntEnum):
    SAFE = 0  # sha256 of the whole model file
    GGUF_CHUNKED = 1  # sha256 of the GGUF header, metadata and first tensor
    FAST_UNSAFE = 2  # supplied by the caller, trusted


@dataclass(frozen=True, slots=True)
class Namespace:
    """What, besides the tokens, a KV state depends on. Rows of different namespaces never mix.

    ``fingerprint`` is the *effective* fingerprint: model file digest folded with any attached
    LoRA adapters (``key.effective_fingerprint``).
    """

    fingerprint: bytes  # 32 bytes
    quant: int  # 0..255
    ctx_hash: bytes  # 32 bytes


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Save gates and flow tunables (erllama's caching guide); overridable per model."""

    min_tokens: int = 512
    cold_min_tokens: int = 512
    cold_max_tokens: int = 30_000
    continued_interval: int = 2048
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048
    #: A checkpoint (a saved state of a model that cannot be trimmed, taken inside or at the
    #: end of a prompt: ``CachePort.pauses``) is skipped when a saved state of the same prompt
    #: lies fewer tokens below it: a later prompt resuming there would prefill at most that
    #: many tokens more, which costs less than packing the checkpoint (~10 MB on the worker for
    #: Gemma 3 270M: a window's state is packed whole, though only its new cells are written).
    checkpoint_gap_tokens: int = 32
    session_resume_wait_ms: int = 500
    evict_save_timeout_ms: int = 30_000


#: The slowest a remote tier's transfer may go, bytes a second averaged over its read timeout
#: (``objects.Pace``): 1 MiB/s restores 45 tokens a second of the embedded model's f16 cells
#: and 8 of an 8B model's, slower than any of them prefills, so a restore that slow is not
#: worth waiting for (docs/configuration.md).
DEFAULT_MIN_BYTES_PER_S = 1 << 20


@dataclass(frozen=True, slots=True)
class S3Config:
    """Where and how the ``s3`` tier talks to an S3-compatible store (AWS, MinIO, Ceph).
    Credentials are not here: boto3's normal chain (env, profile, instance role) finds them."""

    bucket: str
    prefix: str = "kvwarm/"  # object names are <prefix><hex key>.kvc
    endpoint_url: str | None = None  # None: AWS itself
    region: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_attempts: int = 2  # botocore "standard" retries, first attempt included
    # After a network fault the tier answers "miss" without calling the store for this long,
    # so a dead store costs one timeout per interval, not one per lookup.
    down_for_s: float = 5.0
    # A GET or PUT moving fewer bytes a second than this over a read_timeout_s is abandoned
    # as a network fault (botocore's timeouts bound each socket read, not a body). 0: none.
    min_bytes_per_s: int = DEFAULT_MIN_BYTES_PER_S
    # A save's new chunks go into one pack object (``TierCapabilities.pack_writes``). False:
    # each chunk is its own object, as a kvwarm from before packs writes and reads (a rolling
    # upgrade); packs others wrote are read either way.
    packs: bool = True


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier: a name, a quota, and where its store is -- a ``url``, or for the built-in
    names the options below. ``root`` is required for file tiers and must be None for the
    others; ``s3`` for the ``s3`` tier. ``shared``: a file tier's directory is shared by
    several hosts (NFS, CephFS): its bytes are not local (hits are promoted to a local tier)
    and its temp files are reaped by age only (a writer's pid means nothing on another
    host)."""

    name: TierName
    quota_bytes: int
    root: Path | None = None
    shared: bool = False
    s3: S3Config | None = None
    # Where the tier's store is, by URL (``file:///path?shared=1``, ``s3://bucket/prefix/?
    # endpoint=...``, ``ram://``, ``redis://host:port/db``): its scheme picks the store
    # (``tiers.registry.register_scheme``), so a new store needs no field here. None: the
    # store is picked by ``name`` and the fields above (the built-in spellings).
    url: str | None = None


@dataclass(frozen=True, slots=True)
class PressureConfig:
    """Memory-pressure scheduler (off by default)."""

    enabled: bool = False
    source: Literal["noop", "system", "nvidia"] = "system"
    interval_ms: int = 5000
    high_watermark: float = 0.85
    low_watermark: float = 0.75
    min_evict_bytes: int = 1 << 20
    # Evicted from: those of these the cache has (the others are skipped); naming none of its
    # tiers is a ``ConfigError``.
    evict_tiers: tuple[TierName, ...] = ("ram", "ram_file")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    tiers: tuple[TierConfig, ...] = (TierConfig("ram", 1 << 30),)
    writer_threads: int = 2
    writer_queue: int = 8
    reservation_ttl_s: float = 60.0
    ttl_seconds: tuple[float, float, float] = (300.0, 3600.0, 86_400.0)  # by TtlClass
    sweep_interval_s: float = 30.0
    pressure: PressureConfig = field(default_factory=PressureConfig)
    # A row's prompt text is for people reading the files, and it is a user's words at rest:
    # written only when asked for. Lookups never use it (rows are found by tokens).
    store_prompt_text: bool = False
    # Which rows leave first when a tier is over quota or under pressure: a name registered
    # in ``cache.eviction`` (built in: "lru", "lfu").
    eviction: str = "lru"
    # Shared tiers (s3, a shared directory): a hit there is copied to this local tier (None:
    # the first local tier configured); a prefix lookup probes at most ``probe_max`` keys,
    # ``probe_parallel`` at a time (docs/architecture.md, "Shared tiers").
    promote_tier: TierName | None = None
    probe_max: int = 16
    probe_parallel: int = 8
    # Rows are manifests over content-addressed chunks of up to this many tokens (0: every
    # row is one whole blob). Only saves that come with a ``SaveRequest.split`` are chunked.
    chunk_tokens: int = 256
    # A recurrent or hybrid model's saved states are whole (nothing shared): of the rows a
    # newly saved state extends, a local tier keeps this many nearest (the previous turns:
    # a regenerated or edited last message resumes there) and those another conversation
    # also extends (a system prompt's checkpoint); the older states of that conversation go
    # (``Index.retention_victims``). -1 keeps every state ever saved, until evicted.
    state_history: int = 2


@dataclass(frozen=True, slots=True)
class RowInfo:
    """A published row as the index knows it."""

    key: bytes
    tier: TierName
    # The row's own stored bytes: its file or object (a manifest; the whole blob of an
    # unchunked row), or in the ram tier its payload and metadata. Its chunks are not in it.
    size: int
    n_tokens: int
    hits: int
    last_used: float  # unix seconds
    created: float
    reason: SaveReason
    ttl_class: TtlClass
    has_logits: bool
    namespace: Namespace
    # Leading tokens whose KV came from aligned-chunk prefill (None: all of them). Generated
    # tokens are decoded one at a time, so deterministic restores never trim past this.
    canonical_tokens: int | None = None
    # The memory kind of the model that saved it (``kvwarm.memory``: "full", "swa",
    # "recurrent", "hybrid"; "" for a row that does not say: saved by an older kvwarm).
    memory: str = ""
    # Filled by ``rows()`` (0 elsewhere), as of that call: the bytes the row restores from
    # (``size`` plus every chunk it names), and those only it holds (``size`` plus the chunks
    # no other row of its tier names: what deleting it alone would free).
    logical_bytes: int = 0
    exclusive_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TierSizes:
    """One tier's bytes. ``physical_bytes``: stored, each chunk once (manifests or whole rows
    plus unique chunks, orphans included: the files' apparent sizes for a file tier);
    ``logical_bytes``: the sum of its rows' ``logical_bytes``. ``dedup_ratio`` = logical /
    physical (1.0 when nothing is shared; 0 when empty)."""

    physical_bytes: int = 0
    logical_bytes: int = 0
    rows: int = 0
    chunks: int = 0

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.physical_bytes if self.physical_bytes else 0.0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of a longest-prefix lookup: ``row`` shares its first ``n_shared`` tokens with the
    query. ``n_shared`` may be less than ``row.n_tokens`` (the restore is then trimmed)."""

    row: RowInfo
    n_shared: int


@dataclass(frozen=True, slots=True)
class RestChunks:
    """Where a manifest's rest lies when it is a KV cache cut into chunks (an iSWA window:
    ``MemoryKind.rest_chunkable``): the positions ``[first, end)`` it holds, in chunks of
    ``lens`` tokens from ``start`` to ``end`` (the row's length), named by ``keys``. The first
    chunk may start before the window (``start < first``: a wider chunk another row stored,
    whose cells before ``first`` a restore skips). Every chunk ends at a grid point, a cut
    of the row's first-cache chunks or its end, and lies within one first-cache chunk, whose
    chain its key continues (``chunkfmt.rest_chain``)."""

    first: int
    start: int
    lens: tuple[int, ...]
    keys: tuple[bytes, ...]

    @property
    def end(self) -> int:
        return self.start + sum(self.lens)

    def check(self, n_tokens: int) -> None:
        """``ValueError`` unless these chunks cover a window that ends the row's
        ``n_tokens`` and whose first position lies in the first chunk."""
        if len(self.lens) != len(self.keys) or not self.keys:
            raise ValueError("a rest's chunk lengths and keys must pair up, and be some")
        if any(len(k) != 32 for k in self.keys) or any(n <= 0 for n in self.lens):
            raise ValueError("a rest's chunk keys are 32 bytes and its lengths positive")
        if not 0 <= self.start <= self.first < self.start + self.lens[0]:
            raise ValueError(f"a rest from {self.first} does not start in its first chunk")
        if self.end != n_tokens:
            raise ValueError(f"a rest's chunks end at {self.end}, not the row's {n_tokens}")


@dataclass(frozen=True, slots=True)
class PackLoc:
    """Where a chunk lies inside a *pack* (a tier with ``TierCapabilities.packs``): the
    pack's id (``sha256`` of the heads of the chunks it was written with; its object is
    ``packs/<hex id>.kvp``) and the chunk object's bytes ``[offset, offset + length)`` in
    it, exactly what a ``chunks/<hex key>.kvk`` object would hold (``chunkfmt.parse``)."""

    pack: bytes
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """A row to write. ``payload`` is handed over: the caller must not mutate it afterwards."""

    namespace: Namespace
    tokens: tuple[int, ...]
    payload: bytes
    reason: SaveReason
    tier: TierName
    logits: bytes | None = None  # float32 logits after the last token (finish/cold saves)
    prompt_text: str = ""  # observability only; untrusted on load; kept only if configured
    ttl_class: TtlClass = TtlClass.SHORT
    context_size: int = 0
    quant_bits: int = 0
    fingerprint_mode: FingerprintMode = FingerprintMode.SAFE
    canonical_tokens: int | None = None  # see RowInfo.canonical_tokens
    memory: str = ""  # see RowInfo.memory
    # Where this row's KV stops being the bits any row of its tokens computes in whole
    # aligned passes (its canonical prefix aligned down to n_batch; None: it never does):
    # chunks past it are keyed apart (``chunkfmt.chunk_chain``).
    plain_to: int | None = None
    # The backend's codec (``kv_split``): with it, the cache stores ``payload`` as chunks
    # (``cache/store/chunking.py``), writing only those the tier lacks. Run on a writer thread, so
    # it must be pure (the backends' codecs are).
    split: Splitter | None = None
    # With ``split``, for a memory of two parts (``kvwarm.memory.MemoryKind.has_rest``): the
    # manifest's payload is ``rest(payload)``, the state that cannot be cut into chunks; the
    # chunks hold only the first KV cache. A ``StateRestoreError`` from it stores the row
    # whole.
    rest: Rester | None = None
    # With ``rest``, for a rest that is itself a KV cache (``MemoryKind.rest_chunkable``: an
    # iSWA window): the positions it holds, and its splitter (the backend's
    # ``kv_codec.rest_span`` and ``split_rest``). The cache then stores the rest as chunks
    # too, keyed like the first cache's, and the manifest names them (``RestChunks``); a
    # ``StateRestoreError`` from either keeps the rest in the row, whole.
    rest_span: RestSpan | None = None
    split_rest: Splitter | None = None
    # The chunk lengths to cut ``payload`` at (() : the cache plans them). With
    # ``chunk_keys`` set too, the manifest a tier writes (``payload`` is then empty, or the
    # row's rest); with ``split`` too, a copy of a manifest (promotion): its chunks are
    # stored under those keys.
    chunk_lens: tuple[int, ...] = ()
    chunk_keys: tuple[bytes, ...] = ()
    # With ``chunk_keys``: the manifest's rest in chunks (its ``payload`` is then empty), or
    # with ``split_rest`` too, a copied manifest's, stored under those keys.
    rest_chunks: RestChunks | None = None
    # With ``chunk_keys``: where each chunk the manifest names (its first cache's, then its
    # rest's) lies in a pack, None for one stored as its own object; () when none is packed.
    # Set by the save for a tier with packs (``chunking.store_row``), never by a caller.
    chunk_locs: tuple[PackLoc | None, ...] = ()
    # Instead of ``payload`` (then empty): the cache calls ``pack(start)`` on the saving
    # thread once it knows the first planned chunk its tier lacks, so the tokens a tier holds
    # are never copied out of the context again. Needs ``split``.
    pack: Packer | None = None
    # The first position ``payload`` holds: 0, or where a ``pack``ed tail starts; the chunks
    # before it must be in the tier when the row is stored (else the save fails: a row is
    # never stored whole from a tail).
    payload_from: int = 0


@dataclass(frozen=True, slots=True)
class EvictResult:
    rows: int
    bytes: int


# A save writes its chunks and then its manifest within seconds; an hour covers a stalled
# writer and clock skew between hosts and the store (s3 stamps LastModified itself).
DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class SweepResult:
    """One tier's sweep: chunks listed, manifests read, chunks deleted (and the bytes of
    the chunks and packs deleted), unreferenced chunks and packs kept because they were
    younger than the grace period, why the tier was left alone ("" if it was not), and
    packs listed and deleted (a tier with packs)."""

    tier: TierName
    chunks: int = 0
    manifests: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    young: int = 0
    refused: str = ""
    packs: int = 0
    packs_deleted: int = 0
