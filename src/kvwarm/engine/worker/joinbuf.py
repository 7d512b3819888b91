"""The worker's reusable buffer that a chunked row's KV is joined into and restored from,
when the context cannot restore the chunks in place (``kv_unpack_chunks`` returned None:
chunks of the first format, or no room for a scratch sequence; or a row with a rest: an
iSWA window in chunks, a hybrid's recurrent state).

Joining a 2,048-token prefix of the embedded model into a fresh 45 MiB buffer spent most of
its time faulting in new pages; a buffer kept across restores is already faulted, so a
restore copies each KV byte once and touches no new memory (docs/architecture.md, "Chunks").
It is allocated on the first join only, so a worker whose chunks all restore in place never
holds one.

Invariants: a ``JoinBuffer`` belongs to one worker's ``Runtime`` and is used only on that
worker's thread (never shared across threads). It grows to the largest joined blob seen and
is dropped by ``release`` when the worker stops. ``restore`` joins and restores in one call
(``kv_unpack_joined``), so nothing but the join writes the blob the context restores. The
view ``join`` returns is valid until the next ``join``, ``restore`` or ``release``; its caller
keeps no reference after handing it to ``kv_unpack``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvwarm.backends.base import BackendContext, Buffer, WritableBuffer
from kvwarm.backends.kv_codec import join_row
from kvwarm.buffers import Staging, grown_staging
from kvwarm.errors import JoinBufferTooSmallError

T = TypeVar("T")


class JoinBuffer:
    """One worker's join target: grown when a row needs more, released on unload."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        # A ``Staging``: a codec keeps the views a join plan copies into in its memo.
        self._buf: Staging | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else len(self._buf)

    def restore(
        self,
        ctx: BackendContext,
        seq: int,
        chunks: Sequence[Buffer],
        rest: Buffer = b"",
        *,
        rest_chunks: Sequence[Buffer] = (),
        rest_from: int = 0,
    ) -> int:
        """``ctx.kv_unpack_joined`` into this buffer: the row (``chunks`` followed by ``rest``
        or by the window joined from ``rest_chunks``, as for ``join``) restored into ``seq``;
        the number of positions it holds."""
        return self._fitted(
            lambda out: ctx.kv_unpack_joined(
                seq, chunks, out, rest=rest, rest_chunks=rest_chunks, rest_from=rest_from
            )
        )

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
        return self._fitted(
            lambda out: join_row(
                ctx.kv_codec, chunks, out, rest=rest, rest_chunks=rest_chunks, rest_from=rest_from
            )[0]
        )

    def _fitted(self, fill: Callable[[WritableBuffer], T]) -> T:
        """``fill(buffer)``; when the row does not fit (``JoinBufferTooSmallError``, raised
        before anything is restored), the buffer grown to what it needs, and ``fill`` again."""
        try:
            return fill(self._buf.data if self._buf is not None else bytearray())
        except JoinBufferTooSmallError as exc:
            need = exc.needed
        old = self.capacity
        # Drop the old one first: holding both would briefly double the footprint.
        self._buf = None
        self._buf = grown_staging(need, old)
        return fill(self._buf.data)

    def release(self) -> None:
        """Give the memory back (the worker is unloading)."""
        self._buf = None
