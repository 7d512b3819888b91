"""What the ingress sends an engine replica, and what comes back: plain picklable values.

Invariants: every call names its model (a ``SnapshotCall`` names its replica instead, a
``ModelOp`` may name one too); a
``Generate`` carries the request's ``chain`` (``chains``) so the router can place it without
the body; a replica answers a ``Generate`` with
a ``Served`` marker first (which replica, so the ingress can say), then text fragments (the
first one after a ``Prompted``, when prompt logprobs were asked for), then exactly one
``Finished`` or ``Failed``. Errors travel as ``Failed(exc)`` rather than as Ray's
wrapped exceptions, so the ingress re-raises the engine's own typed error and maps it by type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvwarm.engine.ops import OpName
from kvwarm.engine.types import Completion, GenerationOptions, TokenLogprob

GenerateKind = Literal["chat", "text", "text_quiet"]  # text_quiet: Model.submit (no fragments)


@dataclass(frozen=True, slots=True)
class Generate:
    model_id: str
    kind: GenerateKind
    options: GenerationOptions
    chain: tuple[str, ...] = ()
    messages: Sequence[Mapping[str, object]] = ()
    tools: Sequence[Mapping[str, object]] | None = None
    prompt: str | tuple[int, ...] = ""
    prefill: str = ""  # chat: text the reply continues (``ModelStreams.stream_chat``)
    avoid: tuple[str, ...] = ()  # replicas lost under an earlier attempt of this call
    # The prompt's token ids as the ingress made them (routing only: the replica tokenizes
    # again from ``messages``/``prompt``); () when the ingress has no tokenizer for it.
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelOp:
    """A call that is not a generation: ``op`` names one of ``engine.ops.CALLS`` (tokenize,
    template, embed, prewarm, info, ...); the replica refuses any other name."""

    model_id: str
    op: OpName
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = field(default_factory=dict)
    chain: tuple[str, ...] = ()  # prewarm: where the prefix should live
    # Seconds the ingress waits for the answer (routing included) before it cancels the call
    # and answers ``ReplicaTimeoutError``; None: no deadline.
    timeout_s: float | None = None
    # The replica to run on, by id (a prewarm goes to every replica, one call each): the
    # router routes it there only and that replica refuses it if it is another; None: any.
    replica: str | None = None


@dataclass(frozen=True, slots=True)
class SnapshotCall:
    """Ask one replica, by id, for its cache facts' snapshot (``EventLog.snapshot``): the
    router routes it to that replica only, never another."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class Served:
    replica_id: str


@dataclass(frozen=True, slots=True)
class Prompted:
    """The prompt's tokens and their logprobs, before the first fragment (sent only when
    prompt logprobs were asked for): a streamed ``echo`` with ``logprobs`` writes them in its
    first chunk, as ``kvwarm serve`` does, before the reply's end brings the ``Completion``."""

    prompt_tokens: tuple[int, ...]
    prompt_logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    completion: Completion


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


StreamItem = Served | Prompted | str | Finished | Failed
