"""The exception tree of kvwarm.

Every failure a caller can observe is a ``KvwarmError`` subclass. Native (llama.cpp) and I/O
errors are translated once, at the boundary that meets them (``backends/`` and ``cache/tiers``);
the server maps exception *types* to HTTP statuses, never message text.

    KvwarmError
    ├── ConfigError            (also ValueError)  bad settings, caught at construction
    │   ├── UnsafeCacheDirError                   a cache directory other users can write
    │   └── CacheDirMissingError                  a read-only open of a cache directory
    │                                             that does not exist (never created)
    ├── InvalidRequestError    (also ValueError)  bad per-request options or inputs
    │   ├── ContextOverflowError                  prompt (+ generation) exceeds n_ctx
    │   ├── GrammarError                          GBNF / JSON schema that does not compile
    │   ├── FimNotSupportedError                  fill-in-the-middle on a model without FIM tokens
    │   ├── InvalidModelFileError (also ModelLoadError)  a file given as a model that is not
    │   │   │                                     one the backend loads: a header that is
    │   │   │                                     not GGUF's, cut short, an architecture or
    │   │   │                                     metadata llama.cpp refuses
    │   │   └── NotAModelError                    ... no GGUF magic at all
    │   ├── MediaError                            an image or audio part over a limit, of a
    │   │                                         format not allowed, truncated or hostile
    │   └── CapabilityError                       an operation the model cannot do (rerank on a
    │                                             model that does not rank, generate on a reranker)
    ├── ModelNotFoundError                        no such model file / embedded model missing
    ├── UnknownModelError      (also KeyError)    no loaded model with that id
    ├── ModelExistsError                          a model id loaded twice
    ├── ModelBusyError                            unloading a model that has requests in flight
    ├── ModelCapacityError                        max_loaded_models reached, every model busy
    ├── ModelLoadError                            the model could not be loaded here (out of
    │                                             memory, a file it cannot read; a file that
    │                                             is no loadable model: InvalidModelFileError)
    ├── BackendError                              any other native failure
    │   ├── NoLogitsError                         decode/sample with no logits available
    │   ├── StateRestoreError                     KV blob of wrong size / from another model
    │   ├── HandleClosedError                     use of a freed model, context or sampler
    │   └── AdapterError                          LoRA adapter load / attach failure
    ├── EngineClosedError                         request to an engine or model that shut down
    ├── ReplicaUnavailableError                   a cluster replica died or was unreachable
    │   └── ReplicaTimeoutError                   ... or did not answer a call in time
    ├── QueueFullError                            admission refused: too many queued requests
    ├── KeepAliveFullError                        keep-alive holds as many prefixes as allowed
    └── CacheError
        ├── CacheFormatError                      a malformed or foreign KVC file / blob
        │   ├── ChunkFormatError                  ... a chunk object's, naming it (set aside)
        │   └── CacheNewerFormatError             ... a newer kvwarm's format version: not
        │                                         damage, a miss here, never set aside
        ├── CacheIOError                          the file system refused a save (ENOSPC, EIO…)
        │   └── CacheNetworkError                 a remote store (s3) did not answer in time
        └── CacheKeyError          (also KeyError) a key the cache does not hold
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "AdapterError",
    "BackendError",
    "CacheDirMissingError",
    "CacheError",
    "CacheFormatError",
    "CacheIOError",
    "CacheKeyError",
    "CacheNetworkError",
    "CacheNewerFormatError",
    "CapabilityError",
    "ChunkFormatError",
    "ConfigError",
    "ContextOverflowError",
    "EngineClosedError",
    "FimNotSupportedError",
    "GrammarError",
    "HandleClosedError",
    "InvalidModelFileError",
    "InvalidRequestError",
    "JoinBufferTooSmallError",
    "KeepAliveFullError",
    "KvwarmError",
    "MediaError",
    "MemoryBudgetError",
    "ModelBusyError",
    "ModelCapacityError",
    "ModelExistsError",
    "ModelLoadError",
    "ModelNotFoundError",
    "NoLogitsError",
    "NotAModelError",
    "QueueFullError",
    "ReplicaTimeoutError",
    "ReplicaUnavailableError",
    "RequestCancelledError",
    "RequestTimeoutError",
    "ServerShuttingDownError",
    "StateRestoreError",
    "UnknownModelError",
    "UnsafeCacheDirError",
]


class KvwarmError(Exception):
    """Root of every error kvwarm raises on purpose."""


class ConfigError(KvwarmError, ValueError):
    """A setting is invalid; raised at construction, never at first use."""


class UnsafeCacheDirError(ConfigError):
    """A cache directory is writable by other users and not ours to fix (we refuse it: anyone
    who can write it can swap rows, or plant links that make us write elsewhere)."""


class CacheDirMissingError(ConfigError):
    """A file tier opened read-only (``kvwarm cache stats``, ``ls``, ``verify``) whose
    directory does not exist: an inspection creates nothing. ``tier`` and ``path`` name it."""

    def __init__(self, message: str, *, tier: str, path: str) -> None:
        super().__init__(message)
        self.tier = tier
        self.path = path


class InvalidRequestError(KvwarmError, ValueError):
    """A request option or input is invalid. ``param`` names the offending field if known."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus requested generation) does not fit the context window."""

    def __init__(
        self, message: str, *, n_tokens: int = 0, n_ctx: int = 0, param: str = "prompt"
    ) -> None:
        super().__init__(message, param=param)
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class GrammarError(InvalidRequestError):
    """A GBNF grammar or JSON schema could not be compiled."""


class FimNotSupportedError(InvalidRequestError):
    """Fill-in-the-middle was asked of a model whose vocabulary has no FIM tokens."""


class MediaError(InvalidRequestError):
    """An image or audio part that cannot be used: over a limit, of a format not allowed,
    truncated or not what it claims (``kvwarm.media``). ``param`` names the part."""


class CapabilityError(InvalidRequestError):
    """The model cannot do what was asked: rerank with a model whose pooling is not rank, or
    generate (or embed) with a reranker, generate with an encoder (``ModelInfo.capabilities``
    says what it can do)."""


class ModelNotFoundError(KvwarmError):
    """The model file does not exist (or the embedded default model is not installed)."""


class UnknownModelError(KvwarmError, KeyError):
    """No loaded model has this id."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message.
        return str(self.args[0]) if self.args else ""


class ModelExistsError(KvwarmError):
    """A model with this id is already loaded."""


class ModelBusyError(KvwarmError):
    """The model has requests in flight, so it cannot be unloaded now."""


class ModelCapacityError(KvwarmError):
    """Loading one more model would pass ``max_loaded_models`` and every loaded model is busy."""


class MemoryBudgetError(ConfigError):
    """The models' weights and contexts and the in-memory cache tiers do not fit the memory
    budget (``memory_budget``); the message shows the arithmetic."""


class ModelLoadError(KvwarmError):
    """The model could not be loaded or its context created: the machine's failure (memory,
    a file it cannot read), or, as ``InvalidModelFileError``, the file's."""


class InvalidModelFileError(ModelLoadError, InvalidRequestError):
    """A file given as a model is not one the backend can load: a GGUF header cut short or
    malformed, metadata or tensors llama.cpp refuses (an unknown architecture, a missing
    key, a wrong shape, data past the file's end), or metadata it would abort the process on
    (refused before it sees the file). The caller's to fix, not the server's: the message
    names the file and why; ``param`` is ``path``. Still a ``ModelLoadError``."""

    def __init__(self, message: str, *, param: str | None = "path") -> None:
        super().__init__(message, param=param)


class NotAModelError(InvalidModelFileError):
    """A file given as a model is not a GGUF file (no ``GGUF`` magic): the caller's to fix."""


class BackendError(KvwarmError):
    """A native call failed; the process and the handle's owner are still usable."""


class NoLogitsError(BackendError):
    """Decode or sample was asked for logits that do not exist (no prior prefill)."""


class StateRestoreError(BackendError):
    """A KV state blob could not be restored (wrong size, other model, corrupt)."""


class JoinBufferTooSmallError(BackendError):
    """``kv_join`` was handed an output buffer shorter than the joined blob (``needed`` bytes)."""

    def __init__(self, message: str, *, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


class HandleClosedError(BackendError):
    """A model, context, sampler or adapter was used after it was freed."""


class AdapterError(BackendError):
    """A LoRA adapter could not be loaded, attached or detached."""


class EngineClosedError(KvwarmError):
    """The engine or model was shut down; the request was not run."""


class ReplicaUnavailableError(KvwarmError):
    """A cluster replica died or could not be reached while serving the request."""


class ReplicaTimeoutError(ReplicaUnavailableError):
    """A cluster replica did not answer a call within its deadline (``cluster_call_timeout_s``,
    or ``request_timeout_s`` for a call that runs the model); the call was cancelled there."""


class RequestTimeoutError(KvwarmError):
    """A request ran past the server's deadline (``request_timeout_s``) and was ended."""


class RequestCancelledError(KvwarmError):
    """The caller cancelled the request (``engine.cancel.Cancellation``; the server: its client
    went away) before it was answered; what it had not yet run was cancelled."""


class ServerShuttingDownError(KvwarmError):
    """The server is shutting down: a generation still running at the end of its graceful
    wait is ended with this error (``server/connections.py``)."""


class QueueFullError(KvwarmError):
    """The model's request queue is full; try again later."""


class KeepAliveFullError(KvwarmError):
    """Keeping one more prefix warm would pass the keep-alive's entry or token limit."""


class CacheError(KvwarmError):
    """Root of cache failures."""


class CacheFormatError(CacheError):
    """A KVC file or blob is malformed, truncated, corrupt or for another key."""


class ChunkFormatError(CacheFormatError):
    """A chunk object is malformed, truncated, corrupt or for another key. ``key`` names it:
    every row naming it fails alike, so the cache sets the object itself aside."""

    def __init__(self, message: str, *, key: bytes) -> None:
        super().__init__(message)
        self.key = key


class CacheNewerFormatError(CacheFormatError):
    """A row or chunk written in a format version newer than this kvwarm reads (a newer
    kvwarm sharing the directory or store, or one before a rollback). Nothing proves its bytes
    bad: it is a miss here, and no scan, sweep or save of this kvwarm sets it aside, deletes
    it or replaces it (the newer kvwarm reads it)."""


class CacheIOError(CacheError):
    """The file system refused a cache operation; nothing was published. ``errno`` is the
    underlying OS error number (ENOSPC, EIO, ...) when there was one. It says nothing about
    the bytes of the file it was reading: a scan leaves such a file where it is."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    @property
    def exhausted(self) -> bool:
        """This process ran out of a resource (file descriptors, memory): every other file
        would fail the same way, so a scan stops rather than go on file by file."""
        return self.errno in _EXHAUSTED


_EXHAUSTED = frozenset((_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM, _errno.ENOBUFS))


class CacheNetworkError(CacheIOError):
    """A remote tier (s3) could not be reached, timed out or answered 5xx after its bounded
    retries. The cache degrades it to a miss (lookups) or a dropped save; never a failed
    request."""


class CacheKeyError(CacheError, KeyError):
    """The cache holds no row with this key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
