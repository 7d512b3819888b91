"""Lengths handed to llama.cpp as int32 never wrap (found by review): ctypes converts a
Python int to a C int32 silently modulo 2**32, and llama_detokenize's first buffer was
``8 * n + 16`` bytes, past 2**31 from ~268M tokens: negative in C, where detokenize
asserts ``avail >= 0`` and aborts the process. No llama.cpp here: a recording stand-in
for the library and its buffers, and a sequence that reports a huge length without holding
it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any, overload

import pytest

from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.llama import model as model_module
from kvwarm.backends.llama.model import LlamaModel
from kvwarm.errors import InvalidRequestError

INT32_MAX = 2**31 - 1


class _Huge(Sequence[int]):
    """``n`` tokens, all id 1, without storing them."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            raise NotImplementedError
        return 1

    def __iter__(self) -> Iterator[int]:
        yield 1  # the checks and the C array see one token; only the length is huge


class _Lib:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def llama_detokenize(self, _vocab: Any, _arr: Any, n: int, _buf: Any, cap: int, *_: Any) -> int:
        self.calls.append((n, cap))
        return 0


class _Array:
    """``ctypes.c_int32 * n`` without the n * 4 bytes."""

    def __mul__(self, _n: int) -> Any:
        return lambda *_items: None


@pytest.fixture(autouse=True)
def _no_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SimpleNamespace(
        c_int32=_Array(), create_string_buffer=lambda _n: SimpleNamespace(raw=b"")
    )
    monkeypatch.setattr(model_module, "ctypes", fake)


def _model(lib: _Lib) -> LlamaModel:
    model = object.__new__(LlamaModel)
    model._lib = lib
    model._vocab = None
    model._n_vocab = 10
    model._life = Lifetime("model", lambda: None)
    return model


def test_the_first_buffer_of_268m_tokens_fits_an_int32() -> None:
    lib = _Lib()
    assert _model(lib).detokenize(_Huge(268_435_456)) == ""
    ((n, cap),) = lib.calls
    assert n == 268_435_456
    assert 0 < cap <= INT32_MAX


def test_more_tokens_than_an_int32_counts_is_a_typed_error() -> None:
    lib = _Lib()
    with pytest.raises(InvalidRequestError, match="more than one detokenize takes"):
        _model(lib).detokenize(_Huge(2**31))
    assert lib.calls == []
