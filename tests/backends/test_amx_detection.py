"""AMX detection (``backends/_native``): a build counts as AMX when any of its CPU libraries
reports ``ggml_cpu_has_amx_int8``, including the per-variant libraries of a
``GGML_CPU_ALL_VARIANTS`` build. Fake library files and a fake loader stand in for ggml."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import pytest

from kvwarm.backends.llama import native as _native


class _Probe:
    def __init__(self, value: int) -> None:
        self.value = value
        self.restype: object = None
        self.argtypes: object = None

    def __call__(self) -> int:
        return self.value


class _Lib:
    def __init__(self, amx: int | None) -> None:
        if amx is not None:
            self.ggml_cpu_has_amx_int8 = _Probe(amx)


def fake_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, libs: dict[str, int | None]
) -> list[str]:
    """A fake ``llama_cpp`` package whose ``lib/`` holds ``libs`` (file name -> what its AMX
    probe reports; None: no probe exported). Returns the names the loader was asked for."""
    package = tmp_path / "llama_cpp"
    (package / "lib").mkdir(parents=True)
    for name in libs:
        (package / "lib" / name).write_bytes(b"")
    module = types.ModuleType("llama_cpp")
    module.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    loaded: list[str] = []

    def load(path: str, *_args: object, **_kwargs: object) -> _Lib:
        name = Path(path).name
        if name not in libs:
            raise OSError(f"not a fake library: {name}")
        loaded.append(name)
        return _Lib(libs[name])

    monkeypatch.setattr(ctypes, "CDLL", load)
    return loaded


def test_a_single_cpu_library_built_with_amx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_build(tmp_path, monkeypatch, {"libggml-cpu.so": 1, "libggml-base.so": None})
    assert _native._built_with_amx()


def test_a_single_cpu_library_without_amx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_build(tmp_path, monkeypatch, {"libggml-cpu.so": 0})
    assert not _native._built_with_amx()


def test_an_amx_variant_among_per_cpu_variants_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sorted, haswell and icelake come first and report 0: the first answer is not the answer.
    loaded = fake_build(
        tmp_path,
        monkeypatch,
        {
            "libggml-cpu-haswell.so": 0,
            "libggml-cpu-icelake.so": 0,
            "libggml-cpu-sapphirerapids.so": 1,
            "libggml-cpu-x64.so": 0,
        },
    )
    assert _native._built_with_amx()
    assert "libggml-cpu-sapphirerapids.so" in loaded


def test_variants_without_amx_and_libraries_without_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_build(
        tmp_path,
        monkeypatch,
        {"libggml-cpu-haswell.so": 0, "libggml-cpu-icelake.so": 0, "libggml-cpu-odd.so": None},
    )
    assert not _native._built_with_amx()


def test_amx_in_use_needs_the_cpu_flag_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "_AMX", None)
    monkeypatch.setattr(_native, "_built_with_amx", lambda: True)
    monkeypatch.setattr(_native, "_cpu_flag", lambda flag: flag == "amx_int8")
    assert _native.amx_in_use()
    monkeypatch.setattr(_native, "_AMX", None)
    monkeypatch.setattr(_native, "_cpu_flag", lambda _flag: False)
    assert not _native.amx_in_use()
