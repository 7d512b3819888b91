"""The ingress side of a replica call: a model and a stream that forward to the engine
deployment through a Ray Serve handle, shaped as ``server.served`` wants them.

Invariants: each generation is one handle call carrying a ``calls.Generate`` with the
request's chain, so the router places it by prefix; the replica's ``Failed`` is re-raised as
the engine's own error, and a replica lost mid-call becomes ``ReplicaUnavailableError``.
Blocking calls (``.result()``) run only on the thread pool, as the routes already call model
methods there; ``info`` is fetched once at start-up and kept. A follow-up carries its previous
turn's row key as ``parent_key`` (``chains.LastRows``), so whichever replica serves it can
restore that row from a shared tier by exact key. What a replica finished (its chain, its
finish row, its tokens) is noted in the cluster's index (``ServedFacts``) before the response
ends, so the client's next turn finds its replica whatever the replica's events say yet.
Every other call carries its deadline (``OpDeadlines``); a prewarm goes to every running
replica; a model's generations in flight are bounded (``max_in_flight``: past it a
``QueueFullError``, admitted when the stream is made and given back when it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar, cast

from kvwarm.cache.types import TtlClass
from kvwarm.cluster import chains
from kvwarm.cluster.calls import (
    Failed,
    Finished,
    Generate,
    GenerateKind,
    ModelOp,
    Prompted,
    Served,
)
from kvwarm.engine.cancel import Cancellation, check_cancel
from kvwarm.engine.ops import ModelCalls, ModelOps, OpName
from kvwarm.engine.request import Fragment
from kvwarm.engine.submit import choice_options
from kvwarm.engine.types import (
    Completion,
    CompletionStats,
    GenerationOptions,
    ModelInfo,
    ModelStatus,
    TokenLogprob,
)
from kvwarm.errors import KvwarmError, QueueFullError, ReplicaUnavailableError

if TYPE_CHECKING:
    from kvwarm.cluster.tokens import PromptTokens
    from kvwarm.engine.ops import Message
    from kvwarm.settings import Settings

log = logging.getLogger("kvwarm.cluster.remote")

# A generation whose replica is lost before any text came back is sent again this many times.
CALL_RETRIES = 2
# The calls that run the model (a prefill or more): their deadline is ``request_timeout_s``,
# a generation's; the others (tokenize, templates, info) take ``cluster_call_timeout_s``.
MODEL_PASS_OPS: frozenset[OpName] = frozenset({"embed", "rerank", "prewarm", "prewarm_chat"})

_P = ParamSpec("_P")
_R = TypeVar("_R")
_V = TypeVar("_V")


class ResponseStream(Protocol):
    """What a streaming handle call returns (Ray's ``DeploymentResponseGenerator``)."""

    def __anext__(self) -> Awaitable[object]: ...

    def cancel(self) -> None: ...


class StreamCall(Protocol):
    """``handle.options(stream=True).generate.remote`` (typed at this seam only)."""

    def __call__(self, call: Generate) -> ResponseStream: ...


class OpCall(Protocol):
    """``handle.call.remote(op).result()``; ``cancel``, when given, cancels the call on its
    replica (``HandleCalls.op``)."""

    def __call__(self, op: ModelOp, cancel: Cancellation | None = None) -> object: ...


class ServedFacts(Protocol):
    """Where the ingress says what a replica just served (``routing.ClusterIndex``): the
    router then knows it before the replica's own events arrive."""

    def note_served(
        self, replica: str, chain: Sequence[str], key: bytes | None, n_tokens: int
    ) -> None: ...


class OpDeadlines:
    """Each non-generation call's deadline in seconds (None: none), from the settings."""

    def __init__(self, call_timeout_s: float = 0.0, model_pass_timeout_s: float = 0.0) -> None:
        self._call = call_timeout_s or None
        self._model_pass = model_pass_timeout_s or None

    @classmethod
    def of(cls, settings: Settings) -> OpDeadlines:
        return cls(settings.cluster_call_timeout_s, settings.request_timeout_s)

    def __call__(self, op: OpName) -> float | None:
        return self._model_pass if op in MODEL_PASS_OPS else self._call


def _cancelled(prompt_tokens: int = 0) -> Completion:
    stats = CompletionStats(
        prompt_tokens=prompt_tokens,
        cached_tokens=0,
        completion_tokens=0,
        prefill_ms=0.0,
        generation_ms=0.0,
        queue_ms=0.0,
        cache_hit="cold",
        finish_reason="cancelled",
        key=None,
    )
    return Completion("", (), (), stats)


def replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (its process, its node) is gone, rather than that it
    answered with an error: only then may a call be sent again elsewhere."""
    try:
        from ray import exceptions as ray_errors
        from ray.serve import exceptions as serve_errors
    except ImportError:  # pragma: no cover - the cluster extra is what runs this
        return False
    lost = (
        ray_errors.RayActorError,  # ActorDiedError, ActorUnavailableError
        ray_errors.WorkerCrashedError,
        ray_errors.NodeDiedError,
        ray_errors.LocalRayletDiedError,
        ray_errors.ObjectLostError,
        serve_errors.ReplicaUnavailableError,
    )
    return isinstance(exc, lost)


def unavailable(exc: BaseException, replica: str | None = None) -> ReplicaUnavailableError:
    """What the client is told of a replica call that failed in Ray (the replica lost, the
    call refused): the error's type, never its message, which is logged here (found by
    review: Ray's messages, the dead worker's address, pid and traceback, reached the
    client)."""
    where = f"replica {replica}" if replica else "a replica"
    log.warning("a call to %s failed: %s: %s", where, type(exc).__name__, exc)
    return ReplicaUnavailableError(f"{where} could not serve the request ({type(exc).__name__})")


class RemoteStream:
    """One replica generation, consumed once (async), ending in a ``Completion``.

    ``start`` sends the call (the router places it, passing over the replicas it names); it
    is sent again, up to ``retries`` times, when the replica is lost (``replica_lost``) before
    any text was handed to the caller: nothing reached the client yet, so another replica can
    serve it whole (a non-streamed request always: ``aresult`` hands out no text). Once text
    was handed out a lost replica ends the stream with ``ReplicaUnavailableError`` (the
    server's error event)."""

    def __init__(
        self,
        start: Callable[[tuple[str, ...]], ResponseStream],
        on_served: Callable[[str], None],
        on_finished: Callable[[str | None, Completion], None] = lambda _replica, _done: None,
        *,
        retries: int = CALL_RETRIES,
        on_retry: Callable[[], None] = lambda: None,
        on_end: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_end``: called once when the stream ends (done, failed or cancelled), or when
        it is dropped unfinished (the ingress's admission count, ``RemoteModel``)."""
        self._on_end = on_end
        weakref.finalize(self, on_end)  # a stream dropped unread still frees its place
        self._start = start
        self._response = start(())
        self._on_served = on_served
        self._on_finished = on_finished
        self._retries = retries
        self._on_retry = on_retry
        self._completion: Completion | None = None
        self._prompted: Prompted | None = None  # before the first text, if asked for
        self._error: BaseException | None = None
        self._cancelled = False
        self._yielded = False
        # While a read waits for the replica's next item: the future ``cancel`` sets (on the
        # reading loop), so a cut never waits on a replica that stopped answering.
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self.replica_id: str | None = None
        self.attempts = 1
        self.lost: list[str | None] = []  # the replicas lost under this call, in order

    @property
    def done(self) -> bool:
        return self._completion is not None or self._error is not None

    def cancel(self) -> None:
        """End the call: cancel it on its replica, and end a read waiting for its next item
        at once, as a cancelled completion (found by review: a read waited for Ray to
        acknowledge the cancel, which a replica that hangs, its process stopped or its
        node cut off, never does until Ray's health checks kill it, so a request cut by its
        deadline, ``request_timeout_s``, or by shutdown hung on well past it)."""
        if not self.done and not self._cancelled:
            self._cancelled = True
            self._response.cancel()
        wake = self._wake
        if wake is not None:  # called from any thread: the reader's loop sets it
            loop, woken = wake
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody reads
                loop.call_soon_threadsafe(_set_once, woken)
        self._on_end()

    def _retry(self, exc: BaseException) -> bool:
        """Send the call again after ``exc`` if it may be: True if it was."""
        if self._yielded or self._cancelled or self.attempts > self._retries:
            return False
        if not replica_lost(exc):
            return False
        log.warning(
            "replica %s lost before answering (%s); sending the request to another",
            self.replica_id or "?",
            type(exc).__name__,
        )
        self.lost.append(self.replica_id)
        self.replica_id = None
        self.attempts += 1
        self._on_retry()
        # A replica Ray calls unavailable may still be running it: cancel it there rather
        # than leave it holding a slot whose text nobody reads.
        try:
            self._response.cancel()
        except Exception as cancel_exc:  # a dead replica's call: nothing left to cancel
            log.debug("the lost call was not cancelled: %s", cancel_exc)
        self._response = self._start(tuple(dict.fromkeys(r for r in self.lost if r is not None)))
        return True

    def __aiter__(self) -> AsyncIterator[str]:
        """The text as it comes: what the caller forwards (a stream's client sees it)."""
        return self._items(forwarded=True)

    async def _items(self, *, forwarded: bool) -> AsyncIterator[str]:
        try:
            async for text in self._read(forwarded=forwarded):
                yield text
        finally:
            if self.done or self._cancelled:
                self._on_end()

    async def _next(self) -> object:
        """The replica's next item; ``_WokenError`` once the stream is cancelled, whether or not
        the replica acknowledges it."""
        if self._cancelled:
            raise _WokenError
        loop = asyncio.get_running_loop()
        step = asyncio.ensure_future(self._response.__anext__())
        woken: asyncio.Future[None] = loop.create_future()
        self._wake = (loop, woken)
        try:
            await asyncio.wait((step, woken), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _abandon(step)
            raise
        finally:
            self._wake = None
        if step.done():
            return step.result()
        _abandon(step)  # what the replica says now reaches nobody
        raise _WokenError

    async def _read(self, *, forwarded: bool) -> AsyncIterator[str]:
        while not self.done:
            try:
                item = await self._next()
            except _WokenError:
                self._completion = _cancelled()
            except StopAsyncIteration:
                self._error = ReplicaUnavailableError("the replica ended the call without a result")
            except KvwarmError as exc:
                self._error = exc
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this task is being cancelled, not just the replica call
                self._completion = _cancelled()
            except Exception as exc:  # Ray's errors: a dead replica, a cancelled call
                if self._cancelled:
                    self._completion = _cancelled()
                elif not self._retry(exc):
                    self._error = unavailable(exc, self.replica_id)
            else:
                text = self._route(item)
                if text:
                    self._yielded = self._yielded or forwarded
                    yield text
        if self._error is not None:
            raise self._error

    def _route(self, item: object) -> str | None:
        if isinstance(item, str):
            return item
        if isinstance(item, Served):
            self.replica_id = item.replica_id
            self._on_served(item.replica_id)
        elif isinstance(item, Prompted):
            self._prompted = item
        elif isinstance(item, Finished):
            self._completion = item.completion
            self._on_finished(self.replica_id, item.completion)
        elif isinstance(item, Failed):
            self._error = item.error
        return None

    async def afragments(self) -> AsyncIterator[Fragment]:
        """The text as fragments: a replica streams text only, so per-token logprobs come
        with the final ``Completion``, not with each fragment."""
        async for text in self:
            yield Fragment(text)

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Known before the first text when asked for (``Prompted``), as on a local stream
        (found by review: only the end brought them, so a streamed ``echo`` with ``logprobs``
        through the ingress wrote its prompt without them)."""
        if self._completion is not None:
            return self._completion.prompt_logprobs
        return self._prompted.prompt_logprobs if self._prompted is not None else None

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        if self._completion is not None:
            return self._completion.prompt_tokens
        return self._prompted.prompt_tokens if self._prompted is not None else ()

    async def aresult(self) -> Completion:
        """The completion; text read only here reaches nobody, so a lost replica's call is
        sent again even after some of it came back (a non-streamed request)."""
        async for _ in self._items(forwarded=False):
            pass
        assert self._completion is not None
        return self._completion


def _forward(
    declared: Callable[Concatenate[ModelCalls, _P], _R],
) -> Callable[Concatenate[RemoteModel, _P], _R]:
    """A ``RemoteModel`` method with ``declared``'s signature that sends its arguments to a
    replica as one ``ModelOp`` named after it, and answers what the replica's model did."""
    name = declared.__name__

    def forward(self: RemoteModel, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        # A caller's Cancellation stays here: it cancels the call (and so the replica's
        # work), it does not cross to the replica (which makes its own).
        sent = dict(kwargs)
        cancel = check_cancel(sent.pop("cancel", None))
        return cast(_R, self._op(name, args, sent, cancel=cancel))

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = declared.__doc__
    return forward


class ModelMemory:
    """What the ingress remembers of one model across its detach and reattach (an idle or
    an admin unload only detaches it; the replicas keep it loaded): each conversation's last
    row (``chains.LastRows``, bounded), the ``parent_key`` of its next turn, and how many
    generations were sent again. ``identity``: what makes its rows its own (file, weights
    fingerprint, template, adapters, configuration); the ingress drops the memory when a
    reattached model's differs, since rows of another model are never a parent."""

    def __init__(self, identity: object = None, capacity: int = 65536) -> None:
        self.identity = identity
        self.last_rows = chains.LastRows(capacity)
        self.retried = 0  # generations sent again after their replica was lost


class RemoteModel(ModelOps):
    """A model served by the engine deployment; ``engine.ops.ModelOps`` for the routes.

    ``on_served`` is told which replica served each generation (the ingress puts it in a
    response header). Chains are computed here, in the ingress, from the request's messages
    or prompt, its cache salt, its tools and its LoRA adapters."""

    def __init__(
        self,
        info: ModelInfo,
        stream_call: StreamCall,
        op_call: OpCall,
        on_served: Callable[[str], None] = lambda _replica: None,
        facts: ServedFacts | None = None,
        tokenizer: PromptTokens | None = None,
        deadlines: OpDeadlines | None = None,
        *,
        replicas: Callable[[], Sequence[str]] = tuple,
        max_in_flight: int | Callable[[], int] = 0,
        memory: ModelMemory | None = None,
    ) -> None:
        """``tokenizer``: the model's vocabulary at the ingress (``tokens.PromptTokens``), so
        each generation carries its prompt's token ids for the router; None: it carries none.
        ``deadlines``: each call's deadline (``OpDeadlines``; None: no deadline).
        ``replicas``: the ids of the replicas running now, each of which a prewarm warms.
        ``max_in_flight``: generations of this model the ingress holds at once (running or
        waiting, anywhere); one more is a ``QueueFullError`` (429). 0: no bound. A function
        is asked at each admission (the bound follows the replicas running).
        ``memory``: what an earlier attach of this model remembered (``ModelMemory``); a
        fresh one when None."""
        self._info = info
        self._deadlines = deadlines or OpDeadlines()
        self._replicas = replicas
        self._max_in_flight = max_in_flight if callable(max_in_flight) else lambda: max_in_flight
        self._admission = threading.Lock()
        self.in_flight = 0  # generations admitted and not ended
        self._tokenizer = tokenizer
        self._stream_call = stream_call
        self._op_call = op_call
        self._on_served = on_served
        self._facts = facts
        self.memory = memory if memory is not None else ModelMemory()
        self._last_rows = self.memory.last_rows

    @property
    def retried(self) -> int:
        """Generations sent again after their replica was lost (since this model's memory
        began: across detaches)."""
        return self.memory.retried

    @property
    def id(self) -> str:
        return self._info.id

    def info(self) -> ModelInfo:
        return self._info

    def status(self) -> ModelStatus:
        """Replicas report their own status (their ``/metrics``, routing stats); the ingress
        holds no slots."""
        return ModelStatus(self.id, "ready", 0, 0, self._info.n_parallel, 0, 0, 0, 0, 0.0, 0.0)

    # --- generation ------------------------------------------------------------------------

    def _admit(self, n: int = 1) -> list[Callable[[], None]]:
        """Room for ``n`` more generations, all or none (``QueueFullError``): one release
        each (idempotent), called when its stream ends."""
        with self._admission:
            limit = self._max_in_flight()
            if limit and self.in_flight + n > limit:
                raise QueueFullError(
                    f"model {self.id}: {self.in_flight} requests in flight across the replicas "
                    f"(at most {limit}); try again later"
                )
            self.in_flight += n
        return [self._release_once() for _ in range(n)]

    def _release_once(self) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            with self._admission:
                if not released:
                    released = True
                    self.in_flight -= 1

        return release

    def _generate(
        self,
        kind: GenerateKind,
        options: GenerationOptions | None,
        release: Callable[[], None] | None = None,
        **fields: object,
    ) -> RemoteStream:
        """One generation's stream; ``release``: its admission (``_admit``), else one is
        taken here. The admission is given back if the stream is not made."""
        if release is None:
            (release,) = self._admit()
        try:
            return self._new_stream(kind, options, release, **fields)
        except BaseException:
            release()
            raise

    def _new_stream(
        self,
        kind: GenerateKind,
        options: GenerationOptions | None,
        release: Callable[[], None],
        **fields: object,
    ) -> RemoteStream:
        opts = options or GenerationOptions()
        opts.validate()  # a bad option is a 400 here, before any replica is bothered
        chain = fields["chain"]
        assert isinstance(chain, tuple)
        parent = self._last_rows.parent_of(chain)
        if opts.parent_key is None and parent is not None:
            # The previous turn's row: found by exact key on any replica sharing its tier.
            opts = dataclasses.replace(opts, parent_key=parent)
        call = Generate(model_id=self.id, kind=kind, options=opts, **fields)  # type: ignore[arg-type]
        tokens = self._prompt_tokens(call)
        if tokens:
            call = dataclasses.replace(call, tokens=tokens)

        def finished(replica: str | None, done: Completion) -> None:
            self._last_rows.remember(chain, done.stats.key)
            if self._facts is not None and replica is not None:
                n_tokens = done.stats.prompt_tokens + done.stats.completion_tokens
                self._facts.note_served(replica, chain, done.stats.key, n_tokens)

        def start(avoid: tuple[str, ...]) -> ResponseStream:
            return self._stream_call(dataclasses.replace(call, avoid=avoid) if avoid else call)

        def retried() -> None:
            self.memory.retried += 1

        return RemoteStream(start, self._on_served, finished, on_retry=retried, on_end=release)

    def _prompt_tokens(self, call: Generate) -> tuple[int, ...]:
        """The call's prompt as token ids, for the router; () without a tokenizer or when
        it fails here (the replica will say why, if the request is bad)."""
        if self._tokenizer is None:
            return ()
        try:
            if call.kind == "chat":
                return self._tokenizer.chat(call.messages, call.tools)
            return self._tokenizer.text(call.prompt, call.options)
        except Exception as exc:
            log.debug("prompt not tokenized at the ingress: %s", exc)
            return ()

    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        prefill: str = "",
    ) -> RemoteStream:
        return self._chat(messages, tools, options, prefill)

    def _chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, object]] | None,
        options: GenerationOptions | None,
        prefill: str = "",
        release: Callable[[], None] | None = None,
    ) -> RemoteStream:
        salt = options.cache_salt if options else None
        lora = options.lora if options else None
        chain = chains.chat_chain(self.id, messages, cache_salt=salt, tools=tools, lora=lora)
        return self._generate(
            "chat",
            options,
            release,
            messages=list(messages),
            tools=tools,
            prefill=prefill,
            chain=chain,
        )

    def _text(
        self,
        kind: GenerateKind,
        prompt: str | Sequence[int],
        options: GenerationOptions | None,
        release: Callable[[], None] | None = None,
    ) -> RemoteStream:
        salt = options.cache_salt if options else None
        lora = options.lora if options else None
        chain = chains.text_chain(self.id, prompt, cache_salt=salt, lora=lora)
        value = prompt if isinstance(prompt, str) else tuple(prompt)
        return self._generate(kind, options, release, prompt=value, chain=chain)

    def _each(
        self,
        choices: Sequence[GenerationOptions],
        make: Callable[[GenerationOptions, Callable[[], None]], RemoteStream],
    ) -> list[RemoteStream]:
        """One stream per choice, admitted together: all of them or a ``QueueFullError``."""
        releases = self._admit(len(choices))
        streams: list[RemoteStream] = []
        try:
            for opts, release in zip(choices, releases, strict=True):
                streams.append(make(opts, release))
        except BaseException:
            for stream in streams:
                stream.cancel()
            for release in releases:
                release()
            raise
        return streams

    def stream(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> RemoteStream:
        return self._text("text", prompt, options)

    def submit(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> RemoteStream:
        return self._text("text_quiet", prompt, options)

    # n > 1 through the ingress: one generation per choice (seed + i), each placed by the
    # router; prefix affinity usually puts them on one replica, whose live KV they then share.

    def streams(
        self,
        prompt: str | Sequence[int],
        options: GenerationOptions | None = None,
        *,
        n: int,
        fragments: bool = True,
    ) -> list[RemoteStream]:
        choices = choice_options(options or GenerationOptions(), n, self._info.n_parallel)
        kind: GenerateKind = "text" if fragments else "text_quiet"
        return self._each(choices, lambda opts, release: self._text(kind, prompt, opts, release))

    def chat_streams(
        self,
        messages: Sequence[Message],
        *,
        n: int,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        fragments: bool = True,
    ) -> list[RemoteStream]:
        choices = choice_options(options or GenerationOptions(), n, self._info.n_parallel)
        return self._each(
            choices, lambda opts, release: self._chat(messages, tools, opts, release=release)
        )

    # --- everything else: one blocking call each (the routes call these on the thread pool) -

    def _op(
        self,
        op: OpName,
        args: tuple[object, ...],
        kwargs: Mapping[str, object],
        chain: tuple[str, ...] = (),
        replica: str | None = None,
        *,
        cancel: Cancellation | None = None,
    ) -> object:
        call = ModelOp(
            self.id,
            op,
            tuple(_plain(a) for a in args),
            _plain(dict(kwargs)),
            chain,
            timeout_s=self._deadlines(op),
            replica=replica,
        )
        try:
            result = self._op_call(call) if cancel is None else self._op_call(call, cancel)
        except KvwarmError:
            raise
        except Exception as exc:
            raise unavailable(exc, replica) from exc
        if isinstance(result, Failed):
            raise result.error
        return result

    def _op_everywhere(
        self,
        op: OpName,
        args: tuple[object, ...],
        kwargs: Mapping[str, object],
        chain: tuple[str, ...],
        only: str | None = None,
    ) -> object:
        """``op`` on every running replica at once (a prewarm: each replica's RAM gets the
        prefix, so a conversation finds it warm wherever it is routed), or on replica ``only``
        alone; the first replica's answer. A replica that fails is logged and passed over; if
        all fail, the first error. No replica known (no router in this process): one call,
        routed by ``chain``."""
        replicas = [only] if only is not None else list(dict.fromkeys(self._replicas()))
        if not replicas:
            return self._op(op, args, kwargs, chain)

        def one(replica: str) -> object:
            try:
                return self._op(op, args, kwargs, chain, replica)
            except Exception as exc:
                return _Error(exc)

        with ThreadPoolExecutor(len(replicas), thread_name_prefix="kvwarm-fanout") as pool:
            results = list(pool.map(one, replicas))
        errors = [r.error for r in results if isinstance(r, _Error)]
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, _Error) and len(errors) < len(results):
                log.warning("%s on replica %s failed: %s", op, replica, result.error)
        answers = [r for r in results if not isinstance(r, _Error)]
        if not answers:
            raise errors[0]
        return answers[0]

    # The non-streaming operations of ``engine.ops.ModelCalls``, forwarded by name; the
    # replica dispatches by name too. ``info`` (kept from start-up) and ``prewarm`` (which
    # carries its chain, so the router places the prefix) are the explicit ones above/below.
    tokenize = _forward(ModelCalls.tokenize)
    detokenize = _forward(ModelCalls.detokenize)
    token_pieces = _forward(ModelCalls.token_pieces)
    apply_chat_template = _forward(ModelCalls.apply_chat_template)
    chat_tokens = _forward(ModelCalls.chat_tokens)
    count_chat_tokens = _forward(ModelCalls.count_chat_tokens)
    infill_tokens = _forward(ModelCalls.infill_tokens)
    embed = _forward(ModelCalls.embed)
    rerank = _forward(ModelCalls.rerank)

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        ttl_class: TtlClass = TtlClass.LONG,
        add_special: bool = True,
        cache_salt: str | None = None,
        on: str | None = None,
    ) -> CompletionStats:
        """On every running replica, or on replica ``on`` alone (one that just joined)."""
        out = self._op_everywhere(
            "prewarm",
            (prompt,),
            {"ttl_class": ttl_class, "add_special": add_special, "cache_salt": cache_salt},
            chains.text_chain(self.id, prompt, cache_salt=cache_salt),
            on,
        )
        assert isinstance(out, CompletionStats)
        return out

    def prewarm_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        ttl_class: TtlClass = TtlClass.LONG,
        cache_salt: str | None = None,
        on: str | None = None,
    ) -> CompletionStats:
        """On every running replica, or on replica ``on`` alone (one that just joined)."""
        out = self._op_everywhere(
            "prewarm_chat",
            (messages,),
            {"tools": tools, "ttl_class": ttl_class, "cache_salt": cache_salt},
            # Where a chat that starts with these messages will be routed.
            chains.chat_chain(self.id, messages, cache_salt=cache_salt, tools=tools),
            on,
        )
        assert isinstance(out, CompletionStats)
        return out


class _WokenError(Exception):
    """A read ended by ``RemoteStream.cancel``, not by its replica."""


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _abandon(step: asyncio.Future[object]) -> None:
    """Cancel a read nobody waits for any more; its outcome is retrieved (asyncio logs one
    never retrieved)."""
    step.cancel()
    step.add_done_callback(lambda done: None if done.cancelled() else done.exception())


@dataclasses.dataclass(frozen=True, slots=True)
class _Error:
    error: BaseException


def _plain(value: _V) -> _V:
    """``value`` with every sequence but a string (or a dataclass) made a list, recursively,
    mappings' values included: what crosses the handle is plain and picklable."""
    if isinstance(value, str | bytes) or dataclasses.is_dataclass(value):
        return value
    if isinstance(value, Mapping):
        return cast(_V, {k: _plain(v) for k, v in value.items()})
    if isinstance(value, Sequence):
        return cast(_V, [_plain(v) for v in value])
    return value
