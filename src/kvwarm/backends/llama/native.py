"""Process-wide glue to ``llama_cpp``: one-time backend init, logging bridge, type tables.

Invariants:

- ``llama_cpp`` is imported here and only via ``lib()``; importing this module does not load the
  native library.
- ``llama_backend_init`` runs at most once per process, under a lock.
- The ctypes log callback handed to ``llama_log_set`` (and ``mtmd_log_set``, the projector's)
  is stored in a module global for the life of the process: C keeps the raw pointer, and a
  collected callback would be a call into freed memory on the next log line.
- llama.cpp's log lines go to the ``kvwarm.llama_cpp`` logger; by default only WARNING and above
  are formatted at all (the callback returns before building a string for filtered levels).
  Warnings that do not hold for kvwarm's contexts (``_DEMOTED``) are logged at DEBUG.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import cast

from kvwarm.backends.params import POOLING_BY_ID
from kvwarm.errors import ModelLoadError

log = logging.getLogger("kvwarm.llama_cpp")

_LOCK = threading.Lock()
_LIB: ModuleType | None = None
_LOG_CALLBACK: object | None = None  # the CFUNCTYPE object C holds a pointer to
_MIN_LEVEL = logging.WARNING
_LAST_LEVEL = logging.INFO

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the last line).
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5

#: GGML tensor type ids for the KV cache types kvwarm accepts (ggml.h ``enum ggml_type``).
GGML_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}

#: llama_pooling_type ids.
POOLING = {name: i for i, name in enumerate(POOLING_BY_ID)}

# Nominal bits per weight of LLAMA_FTYPE_* values; the cache key's quant byte is the ftype.
_FTYPE_BITS = {
    0: 32, 1: 16, 32: 16,  # F32, F16, BF16
    2: 4, 3: 4, 14: 4, 15: 4, 25: 4, 30: 4, 38: 4, 39: 4,  # Q4_*, IQ4_*, MXFP4, NVFP4
    7: 8,  # Q8_0
    8: 5, 9: 5, 16: 5, 17: 5,  # Q5_*
    18: 6,  # Q6_K
    10: 2, 19: 2, 20: 2, 21: 2, 28: 2, 29: 2, 37: 2, 41: 2,  # Q2_K*, IQ2_*, TQ2_0, Q2_0
    11: 3, 12: 3, 13: 3, 22: 3, 23: 3, 26: 3, 27: 3,  # Q3_K*, IQ3_*
    24: 1, 31: 1, 36: 1, 40: 1,  # IQ1_*, TQ1_0, Q1_0
}  # fmt: skip


def quant_bits(ftype: int) -> int:
    """Nominal bits per weight of a ``general.file_type``; 0 if unknown."""
    return _FTYPE_BITS.get(ftype & ~1024, 0)  # 1024 = LLAMA_FTYPE_GUESSED flag


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# Warnings that are false for kvwarm's contexts, logged at DEBUG instead. llama.cpp compares
# the *total* cells of a unified KV buffer (n_ctx_slot * n_parallel) with n_ctx_train, but a
# slot's positions never pass n_ctx_slot; the engine warns itself when n_ctx_slot does
# (``engine.model``).
_DEMOTED = (b"-- possible training context overflow",)


# Lines llama.cpp logs on a thread inside ``captured_log()`` (whatever their level): how a
# context learns the sizes of the buffers llama.cpp allocated for it, which no API returns.
_CAPTURE = threading.local()


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Collect, as text, every line llama.cpp logs on this thread inside the block."""
    lines: list[str] = []
    _CAPTURE.lines = lines
    try:
        yield lines
    finally:
        _CAPTURE.lines = None


def _on_log(level: int, text: bytes | None, _user: object) -> None:
    global _LAST_LEVEL
    capture = getattr(_CAPTURE, "lines", None)
    if capture is not None and text:
        capture.append(text.decode("utf-8", errors="replace"))
    py_level = _LAST_LEVEL if level == _CONT else _LEVELS.get(level, logging.INFO)
    if text and py_level > logging.DEBUG and any(d in text for d in _DEMOTED):
        py_level = logging.DEBUG
    _LAST_LEVEL = py_level
    if py_level < _MIN_LEVEL or not text or not log.isEnabledFor(py_level):
        return
    message = text.decode("utf-8", errors="replace").rstrip("\n")
    if message:
        log.log(py_level, "%s", message)


def set_native_log_level(level: int) -> None:
    """Lowest Python log level forwarded from llama.cpp (default WARNING)."""
    global _MIN_LEVEL
    _MIN_LEVEL = level


def lib() -> ModuleType:
    """The ``llama_cpp`` module, with logging routed and the backend initialised (once)."""
    global _LIB, _LOG_CALLBACK
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is None:
            try:
                import llama_cpp
            except (ImportError, OSError) as exc:
                raise ModelLoadError(f"llama-cpp-python is not usable: {exc}") from exc
            callback = llama_cpp.llama_log_callback(_on_log)
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            _LOG_CALLBACK = callback
            llama_cpp.llama_backend_init()
            _LIB = llama_cpp
    return _LIB


#: ``llama_get_logits_ith`` returning the address as an int (``c_void_p``): the binding's
#: ``POINTER(c_float)`` result costs a pointer object and a ``ctypes.cast`` a call, and a
#: logits row is read once a generated token.
_LogitsAt = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
_LOGITS_AT: Callable[[object, int], int | None] | None = None


def logits_at() -> Callable[[object, int], int | None]:
    """``llama_get_logits_ith(ctx, i)`` as an address (None: no logits there)."""
    global _LOGITS_AT
    if _LOGITS_AT is None:
        address = ctypes.cast(lib().llama_get_logits_ith, ctypes.c_void_p).value
        if not address:
            raise ModelLoadError("llama-cpp-python has no llama_get_logits_ith")
        _LOGITS_AT = cast("Callable[[object, int], int | None]", _LogitsAt(address))
    return _LOGITS_AT


_MTMD_ROUTED = False


def route_mtmd_log(mtmd: ModuleType) -> None:
    """Send mtmd's (the projector's) log lines through the same callback as llama.cpp's, once
    per process (it logs to stderr otherwise); the callback is the one ``lib`` keeps alive."""
    global _MTMD_ROUTED
    with _LOCK:
        if _MTMD_ROUTED or _LOG_CALLBACK is None:
            return
        mtmd.mtmd_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        _MTMD_ROUTED = True


#: The environment variable that turns llama.cpp's tiled K-quant kernel off (0) or keeps it;
#: ggml reads it once, at its first matrix product (``model_file.tiled_kernel_on``).
TILED_SWITCH = "GGML_CPU_TILED_MM"

#: A context or projector was made in this process: ggml may have read ``GGML_CPU_TILED_MM``
#: (once, at its first product), so setting the variable now would not reach it.
_GRAPHS_MAY_HAVE_RUN = False


def graphs_may_run() -> None:
    """Called before a context or projector is made (``untile_for_exact_rows``)."""
    global _GRAPHS_MAY_HAVE_RUN
    _GRAPHS_MAY_HAVE_RUN = True


def untile_for_exact_rows(why: str) -> bool:
    """Turn llama.cpp's tiled K-quant kernel off for this process (``GGML_CPU_TILED_MM=0``;
    ``model_file.tiled_kernel_on``) where nobody set the variable, ggml cannot have read it
    yet and no other thread runs; True if it did. A model that speculates needs it off to be
    exact with K-quant weights; it costs every model of the process the kernel's speed in
    passes of 8 rows or more (a cold prefill ~1.2x on Gemma 3 270M), as a q8_0 K costs the
    speculating model's.

    Setting a variable (C's ``setenv``) while another thread may read the environment
    (``getenv``: a time zone lookup, a library's settings) is not safe, so a process decides
    at its start, in its main thread before any other starts (``engine/speculating.py``:
    ``kvwarm serve``, ``complete``, ``chat``, ``cache explain``, or a library user before
    making an ``Engine``); a model's load calls this only as the fallback of a process that
    did not, and it refuses while other Python threads run (an engine's cache threads do;
    llama.cpp starts none before its first context, which ends the chance anyway)."""
    with _LOCK:
        if TILED_SWITCH in os.environ or _GRAPHS_MAY_HAVE_RUN:
            return False
        others = threading.active_count() - 1
        if others == 0:
            os.environ[TILED_SWITCH] = "0"
    if others:
        log.warning(
            "llama.cpp's tiled K-quant kernel left on: %s, but %d other threads run in this "
            "process, and setting GGML_CPU_TILED_MM now is not safe; set GGML_CPU_TILED_MM=0 "
            "before starting (a library user: or call kvwarm.engine.api.untile_at_start before "
            "making an Engine)",
            why,
            others,
        )
        return False
    log.info(
        "llama.cpp's tiled K-quant kernel turned off for this process (GGML_CPU_TILED_MM=0): "
        "%s; set GGML_CPU_TILED_MM=1 to keep it (such a model then does not speculate)",
        why,
    )
    return True


def amx_in_use() -> bool:
    """Whether llama.cpp's CPU backend would put weights in its AMX buffer type: built with AMX
    (``ggml_cpu_has_amx_int8``) and running on a CPU whose kernel reports ``amx_int8``."""
    global _AMX
    if _AMX is None:
        _AMX = _cpu_flag("amx_int8") and _built_with_amx()
    return _AMX


_AMX: bool | None = None


def tinyblas_columns() -> int:
    """How many of a pass's rows llamafile's tinyBLAS multiplies a Q8_0, Q4_0, Q5_0 or IQ4_NL
    weight against at once in this build (``ggml-cpu/llamafile/sgemm.cpp``,
    ``tinyBLAS_Q0_AVX::mnpack``): 4 where it was built with AVX-512 (32 vector registers),
    2 with AVX or AVX2; 1 where it has no such kernel (no llamafile, not x86) or the weights
    go to the AMX buffer type. A pass of more rows than that, not a multiple of it, reads
    each such weight once more for the rest (Gemma 3 270M, whose tied Q8_0 output is 90% of
    its weight bytes, on 2 AVX-512 cores: 8 rows 44 ms, 9 rows 61 ms, 12 rows 58 ms), which
    is what speculative decoding's draft lengths weigh (``engine/worker/drafts.Cost``). Read
    from ``llama_print_system_info`` (the CPU variant loaded, where a build has several)."""
    global _TINYBLAS_COLUMNS
    if _TINYBLAS_COLUMNS is None:
        _TINYBLAS_COLUMNS = 1 if amx_in_use() else _columns_of(lib().llama_print_system_info())
    return _TINYBLAS_COLUMNS


_TINYBLAS_COLUMNS: int | None = None


def vector_kernels() -> str:
    """The widest x86 vector set this build's CPU backend was compiled for: "avx512",
    "avx2", "avx", or else "none" (read from ``llama_print_system_info``). Float sums come
    out otherwise from one to the next (a Q4_1 dot product's blocks add in other orders),
    so an output recorded on one (the tests' llama-server references) is another's only
    to rounding."""
    return _vector_set_of(lib().llama_print_system_info())


def _vector_set_of(info: bytes) -> str:
    """``vector_kernels`` from ``llama_print_system_info``'s text."""
    flags = _flags_of(info)
    return next(
        (name.lower() for name in ("AVX512", "AVX2", "AVX") if flags.get(name) == "1"), "none"
    )


def _flags_of(info: bytes) -> dict[str, str]:
    """``llama_print_system_info``'s text ("CPU : AVX2 = 1 | ...") as its flags' values."""
    return {
        name.strip(): value.strip()
        for part in info.decode("ascii", errors="replace").replace("CPU :", "|").split("|")
        if "=" in part
        for name, value in [part.split("=", 1)]
    }


def _columns_of(info: bytes) -> int:
    """``tinyblas_columns`` from ``llama_print_system_info``'s text ("CPU : AVX2 = 1 | ...")."""
    flags = _flags_of(info)
    if flags.get("LLAMAFILE") != "1":
        return 1
    if flags.get("AVX512") == "1":
        return 4
    return 2 if "1" in (flags.get("AVX2"), flags.get("AVX")) else 1


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:  # not Linux: no AMX build of ggml ships there
        return False


def _built_with_amx() -> bool:
    import llama_cpp

    return _any_cpu_lib_has_amx(Path(llama_cpp.__file__).parent / "lib")


def _any_cpu_lib_has_amx(lib_dir: Path) -> bool:
    """Whether any CPU library in ``lib_dir`` was built with AMX.

    A plain build has one ``libggml-cpu.so``; a ``GGML_BACKEND_DL``/``GGML_CPU_ALL_VARIANTS``
    build has one per CPU variant (``libggml-cpu-sapphirerapids.so``, ``-icelake``, ...) and
    ggml loads the best-scoring one for the CPU, which on a CPU reporting ``amx_int8`` is an AMX
    variant whenever one is present. So any library reporting AMX counts, not the first found:
    the caller has already seen ``amx_int8`` in /proc/cpuinfo, so loading a variant built for
    this CPU to ask it is safe (its probe returns a compile-time constant).
    """
    for candidate in sorted(lib_dir.glob("libggml-cpu*")):
        try:
            cpu = ctypes.CDLL(str(candidate))  # the loaded one: same handle; others: harmless
            probe = cpu.ggml_cpu_has_amx_int8
        except (OSError, AttributeError):
            continue
        probe.restype = ctypes.c_int
        probe.argtypes = []
        if probe():
            return True
    return False


def read_string(
    fill: Callable[[ctypes.Array[ctypes.c_char], int], object], initial: int = 256
) -> str:
    """Call ``fill(buf, size) -> needed`` (snprintf-style) until the string fits; decode it."""
    size = initial
    for _ in range(4):
        buf = ctypes.create_string_buffer(size)
        needed = int(cast(int, fill(buf, size)))
        if needed < 0:
            return ""
        if needed < size:
            return buf.raw[:needed].decode("utf-8", errors="replace")
        size = needed + 1
    return ""
