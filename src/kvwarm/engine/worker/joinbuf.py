"""The worker's reusable buffer that a chunked row's KV is joined into before ``kv_unpack``,
when the context cannot restore the chunks in place (``kv_unpack_chunks`` returned None:
chunks of the first format, or no room for a scratch sequence).

Joining a 2,048-token prefix of the embedded model into a fresh 45 MiB buffer spent most of
its time faulting in new pages; a buffer kept across restores is already faulted, so a
restore copies each KV byte once and touches no new memory (docs/architecture.md, "Chunks").
It is allocated on the first join only, so a worker whose chunks all restore in place never
holds one.

Invariants: a ``JoinBuffer`` belongs to one worker's ``Runtime`` and is used only on that
worker's thread (never shared across threads). It grows to the largest joined blob seen and
is dropped by ``release`` when the worker stops. The view ``join`` returns is valid until the
next ``join`` or ``release``; the caller hands it to ``kv_unpack`` (which copies it into the
context) and keeps no reference after that returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwarm.backends.base import BackendContext, Buffer
from kvwarm.buffers import grown
from kvwarm.errors import JoinBufferTooSmallError


class JoinBuffer:
    """One worker's join target: grown when a row needs more, released on unload."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: bytearray | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else len(self._buf)

    def join(
        self,
        ctx: BackendContext,
        chunks: Sequence[Buffer],
        rest: Buffer = b"",
        *,
        rest_chunks: Sequence[Buffer] = (),
        rest_from: int = 0,
    ) -> memoryview:
        """``ctx.kv_join(chunks)`` followed by ``rest`` (a row's state after its chunked KV
        cache: ``KvCodec.rest``), or by the rest joined from ``rest_chunks`` (an iSWA window
        from position ``rest_from``: ``KvCodec.join_rest``), written into this buffer; a view
        of the blob."""
        if rest_chunks:
            return self._join_both(ctx, chunks, rest_chunks, rest_from)
        extra = memoryview(rest).nbytes
        need = 0
        if self._buf is not None:
            try:
                joined = ctx.kv_join(chunks, out=self._buf)
            except JoinBufferTooSmallError as exc:  # refused before writing: grow, retry
                need = exc.needed + extra
            else:
                if joined.nbytes + extra <= len(self._buf):
                    return self._append(joined.nbytes, rest, extra)
                need = joined.nbytes + extra
                joined.release()
        else:
            need = ctx.kv_codec.joined_size(chunks) + extra
        old = self.capacity
        # Drop the old one first: holding both would briefly double the footprint.
        self._buf = None
        self._buf = grown(need, old)
        return self._append(ctx.kv_join(chunks, out=self._buf).nbytes, rest, extra)

    def _join_both(
        self,
        ctx: BackendContext,
        chunks: Sequence[Buffer],
        rest_chunks: Sequence[Buffer],
        rest_from: int,
    ) -> memoryview:
        """Both caches joined one after the other into this buffer, each checked once: a
        join that does not fit is refused before it writes (``JoinBufferTooSmallError``,
        with the size it needs), and the buffer grows to the sum."""
        codec = ctx.kv_codec
        if self._buf is not None:
            view = memoryview(self._buf)
            try:
                head = ctx.kv_join(chunks, out=view).nbytes
                tail = codec.join_rest(rest_chunks, rest_from, out=view[head:]).nbytes
            except JoinBufferTooSmallError:
                pass  # refused before a byte was written: grow below
            else:
                return view[: head + tail]
        need = codec.joined_size(chunks) + codec.rest_size(rest_chunks, rest_from)
        old = self.capacity
        self._buf = None  # holding both would briefly double the footprint
        self._buf = grown(need, old)
        view = memoryview(self._buf)
        head = ctx.kv_join(chunks, out=view).nbytes
        tail = codec.join_rest(rest_chunks, rest_from, out=view[head:]).nbytes
        return view[: head + tail]

    def _append(self, at: int, rest: Buffer, extra: int) -> memoryview:
        """The buffer's first ``at`` bytes (a joined blob) followed by ``rest``, as a view."""
        assert self._buf is not None
        view = memoryview(self._buf)
        view[at : at + extra] = memoryview(rest).cast("B")
        return view[: at + extra]

    def release(self) -> None:
        """Give the memory back (the worker is unloading)."""
        self._buf = None
