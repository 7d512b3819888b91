"""Precondition checks shared by every backend, run before anything reaches native code.

Invariant: each function either returns normally or raises a ``KvwarmError`` subclass; after a
check passes, llama.cpp will not ``GGML_ASSERT`` on the corresponding argument. Backends call
these with their own state (``pos_max``) so the stub and llama.cpp fail identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from numbers import Integral

import numpy as np
import numpy.typing as npt

from kvwarm.alignment import chunk_end
from kvwarm.backends.base import BatchToken, SamplingParams
from kvwarm.errors import ContextOverflowError, InvalidRequestError


def check_seq(seq: int, n_seq_max: int, *, param: str = "seq") -> None:
    if not isinstance(seq, int) or not 0 <= seq < n_seq_max:
        raise InvalidRequestError(f"seq id {seq!r} outside [0, {n_seq_max})", param=param)


def _check_int(value: object, param: str) -> None:
    """``value`` is an integer (numpy's too, not a bool): a float or a string would reach
    ctypes (``TypeError``) or a comparison (``TypeError``) instead of a typed error."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        raise InvalidRequestError(f"{param}: {value!r} is not an integer", param=param)


def check_tokens(tokens: Sequence[int], n_vocab: int) -> None:
    if not tokens:
        return
    for t in tokens:
        _check_int(t, "tokens")
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= n_vocab:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(f"token id {bad} outside [0, {n_vocab})", param="tokens")


#: llama_pos is an int32: ctypes wraps a larger position silently (found by review:
#: seq_rm(seq, 2**32) removed the whole sequence instead of nothing).
_POS_MAX = 2**31 - 1


def check_range(p0: int, p1: int) -> None:
    _check_int(p0, "p0")
    _check_int(p1, "p1")
    for name, value in (("p0", p0), ("p1", p1)):
        if value > _POS_MAX:
            raise InvalidRequestError(
                f"{name} {value} is past the largest position ({_POS_MAX})", param=name
            )
    if p0 < 0:
        raise InvalidRequestError(f"p0 must be >= 0, got {p0}", param="p0")
    if p1 >= 0 and p1 < p0:
        raise InvalidRequestError(f"p1 ({p1}) must be >= p0 ({p0}) or negative", param="p1")


def check_batch(
    batch: Sequence[BatchToken],
    *,
    n_batch: int,
    n_ctx: int,
    n_vocab: int,
    n_seq_max: int,
    pos_max: Callable[[int], int],
) -> None:
    """Validate a decode batch: sizes, ids, and per-seq positions continuing the KV state.

    llama.cpp requires each sequence's positions in a batch to continue exactly after the
    sequence's last stored position; checking here turns its error path into a typed one.
    """
    if not batch:
        raise InvalidRequestError("empty decode batch", param="batch")
    if len(batch) > n_batch:
        raise InvalidRequestError(
            f"batch of {len(batch)} tokens exceeds the {n_batch} one decode may hold "
            "(n_batch, and no more than n_ctx for a causal model)",
            param="batch",
        )
    next_pos: dict[int, int] = {}
    for item in batch:
        seq, token, pos = item.seq, item.token, item.pos
        # Plain ints (every value the engine makes) take the short way; anything else is
        # checked in full, with the same errors.
        if type(seq) is not int or not 0 <= seq < n_seq_max:
            check_seq(seq, n_seq_max)
        if type(token) is not int:
            _check_int(token, "tokens")
        if type(pos) is not int:
            _check_int(pos, "pos")
        if not 0 <= token < n_vocab:
            raise InvalidRequestError(f"token id {token} outside [0, {n_vocab})", param="tokens")
        if pos < 0:
            raise InvalidRequestError(f"negative position {pos}", param="pos")
        if pos >= n_ctx:
            raise ContextOverflowError(
                f"position {pos} is beyond the context window (n_ctx={n_ctx})",
                n_tokens=pos + 1,
                n_ctx=n_ctx,
            )
        expected = next_pos.get(seq)
        if expected is None:
            expected = pos_max(seq) + 1
        if pos != expected:
            raise InvalidRequestError(
                f"seq {seq}: position {pos} does not continue the sequence (expected {expected})",
                param="pos",
            )
        next_pos[seq] = pos + 1


def check_prefill(
    seq: int,
    tokens: Sequence[int],
    start_pos: int,
    *,
    n_ctx: int,
    n_vocab: int,
    n_seq_max: int,
    pos_max: Callable[[int], int],
) -> None:
    check_seq(seq, n_seq_max)
    if not tokens:
        raise InvalidRequestError("prefill needs at least one token", param="tokens")
    if start_pos < 0:
        raise InvalidRequestError(f"negative start_pos {start_pos}", param="start_pos")
    end = start_pos + len(tokens)
    if end > n_ctx:
        raise ContextOverflowError(
            f"{end} positions do not fit the context window (n_ctx={n_ctx})",
            n_tokens=end,
            n_ctx=n_ctx,
        )
    check_tokens(tokens, n_vocab)
    expected = pos_max(seq) + 1
    if start_pos != expected:
        raise InvalidRequestError(
            f"seq {seq}: start_pos {start_pos} does not continue the sequence "
            f"(expected {expected})",
            param="start_pos",
        )


def check_embd(
    seq: int,
    start_pos: int,
    nbytes: int,
    n_tokens: int,
    *,
    n_embd: int,
    room: int,
    n_ctx: int,
    n_seq_max: int,
    pos_max: Callable[[int], int],
) -> None:
    """Validate a span of embeddings (``decode_embd``): its size, that it fits ``room`` (the
    batch; one ubatch for a span attending to itself non-causally, which must be decoded in
    one), and that its positions continue ``seq``."""
    check_seq(seq, n_seq_max)
    _check_int(n_tokens, "n_tokens")
    _check_int(start_pos, "start_pos")
    if n_tokens < 1:
        raise InvalidRequestError("a span has at least one position", param="n_tokens")
    if n_tokens > room:
        raise InvalidRequestError(
            f"a span of {n_tokens} positions does not fit one pass ({room}); it must be "
            "decoded whole: raise n_ubatch and n_batch",
            param="n_tokens",
        )
    if nbytes != 4 * n_embd * n_tokens:
        raise InvalidRequestError(
            f"{nbytes} bytes of embeddings for {n_tokens} positions of width {n_embd} "
            f"(expected {4 * n_embd * n_tokens})",
            param="embd",
        )
    if start_pos < 0:
        raise InvalidRequestError(f"negative start_pos {start_pos}", param="start_pos")
    end = start_pos + n_tokens
    if end > n_ctx:
        raise ContextOverflowError(
            f"{end} positions do not fit the context window (n_ctx={n_ctx})",
            n_tokens=end,
            n_ctx=n_ctx,
        )
    expected = pos_max(seq) + 1
    if start_pos != expected:
        raise InvalidRequestError(
            f"seq {seq}: start_pos {start_pos} does not continue the sequence "
            f"(expected {expected})",
            param="start_pos",
        )


def logits_row(logits: bytes | memoryview, n_vocab: int) -> npt.NDArray[np.float32]:
    """``logits`` (a row's stored logits) as ``n_vocab`` float32 values, without a copy;
    ``InvalidRequestError`` if it holds any other number of bytes."""
    raw = np.frombuffer(logits, dtype=np.uint8)
    if raw.nbytes != n_vocab * 4:
        raise InvalidRequestError(
            f"expected {n_vocab * 4} bytes of float32 logits, got {raw.nbytes}", param="logits"
        )
    return raw.view(np.float32)


def aligned_chunks(start_pos: int, n_tokens: int, n_batch: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` chunks of a prefill whose boundaries fall at absolute positions that
    are multiples of ``n_batch`` (the rule in ``kvwarm.alignment``)."""
    offset = 0
    while offset < n_tokens:
        pos = start_pos + offset
        length = chunk_end(pos, start_pos + n_tokens, n_batch) - pos
        yield offset, length
        offset += length


def resolve_block(first: int, count: int, rows: Sequence[int]) -> int:
    """Where batch rows ``first .. first + count - 1`` begin among ``rows`` (the rows of the
    last decode that asked for logits, in order), if every one of them is there; -1 if not
    (the caller raises ``NoLogitsError``). ``first`` and ``count`` must be integers."""
    _check_int(first, "first")
    _check_int(count, "count")
    if count < 1:
        return -1
    try:
        j = rows.index(first)
    except ValueError:
        return -1
    # ``rows`` only grows: both ends in place means every row between them is too.
    if j + count > len(rows) or rows[j + count - 1] != first + count - 1:
        return -1
    return j


def resolve_row(index: int, rows: Sequence[int]) -> int:
    """Map a caller's row ``index`` (-1: last row with logits) to a batch row holding logits.

    ``rows`` lists, in order, the batch rows of the last decode that asked for logits.
    Returns -1 if there are none (the caller raises ``NoLogitsError``).
    """
    if not rows:
        return -1
    if index == -1:
        return rows[-1]
    return index if index in rows else -1


_INT32_MAX = 2**31 - 1


def check_sampling(params: SamplingParams) -> None:
    """The integers of ``params`` that llama.cpp takes as C ints fit them: ``top_k`` and
    ``repeat_last_n`` (int32) and ``seed`` (uint32). Found by review: ctypes kept a larger
    value's low 32 bits, so ``top_k=2**32 + 1`` sampled as top-1 and ``repeat_last_n=2**32``
    as no penalty window, silently (the engine's options bound them; a backend's caller
    reached them unchecked)."""
    _check_int(params.top_k, "top_k")
    _check_int(params.repeat_last_n, "repeat_last_n")
    if params.top_k > _INT32_MAX:
        raise InvalidRequestError(f"top_k must be <= {_INT32_MAX}", param="top_k")
    if not -1 <= params.repeat_last_n <= _INT32_MAX:
        raise InvalidRequestError(
            f"repeat_last_n must be in [-1, {_INT32_MAX}]", param="repeat_last_n"
        )
    if params.seed is not None:
        _check_int(params.seed, "seed")
        if not 0 <= params.seed < 2**32:
            raise InvalidRequestError("seed must be in [0, 2**32)", param="seed")
