"""The peer for side-by-side benchmarks: llama-server built from the pinned llama-cpp-python's
vendored llama.cpp, once, into a cache directory (never part of ``make test``).

    python bench/peer.py            # build if missing (~7 min on 2 cores), print the binary

The sdist is fetched with pip (a package registry), its ``vendor/llama.cpp`` configured with
``-DLLAMA_BUILD_SERVER=ON`` and only the ``llama-server`` target built, so both servers run
the same llama.cpp. AMX is off, as kvwarm's own build needs (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("KVWARM_BENCH_CACHE", Path.home() / ".cache" / "kvwarm-bench"))


def pinned_version() -> str:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    found = re.search(r'"llama-cpp-python==([^"]+)"', text)
    if found is None:
        raise SystemExit("pyproject.toml pins no llama-cpp-python version")
    return found.group(1)


def llama_server() -> Path:
    """The llama-server binary for the pinned version, built on first use; ``KVWARM_LLAMA_SERVER``
    names another build of it (a CUDA one beside a CUDA build of llama-cpp-python)."""
    given = os.environ.get("KVWARM_LLAMA_SERVER")
    if given:
        return Path(given)
    version = pinned_version()
    binary = CACHE / f"llama-server-{version}" / "llama-server"
    if binary.is_file():
        return binary
    work = Path(tempfile.mkdtemp(prefix="kvwarm-peer-"))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(work)],
            check=True,
        )  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        build = work / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_BF16=OFF", "-DBUILD_SHARED_LIBS=OFF"],
            check=True,
        )  # fmt: skip
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
        )
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
        return binary
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(llama_server())
