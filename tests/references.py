"""llama-server's recorded outputs (the tests' references, where CI has no llama-server), one
file per x86 vector set the pinned llama.cpp was built for on the machine that recorded them
(``native.vector_kernels``): its float sums come out otherwise on AVX2 than on AVX-512 (an
embedding differed by 1.5e-3, a rerank score by 2e-5, a picture's greedy reply after a few
words), so kvwarm on one machine is held to llama-server on a machine of its kind.
``embedding_reference.json`` is read as ``embedding_reference.avx2.json`` on an AVX2 machine;
the scripts that record them (``bench/embedding_reference.py``, ``bench/rerank_reference.py``,
``tests/media_reference.py``) write the file of the machine they run on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvwarm.backends.llama import native


def fixture(path: Path) -> Path:
    """``path``'s file for this machine's vector set: ``name.<set>.json``."""
    return path.with_name(f"{path.stem}.{native.vector_kernels()}{path.suffix}")


def load(path: Path) -> Any:
    """The reference ``path`` recorded on a machine of this one's vector set; a clear error
    where none was (run the script that records it here, with llama-server built)."""
    mine = fixture(path)
    if not mine.exists():
        recorded = sorted(p.name for p in path.parent.glob(f"{path.stem}.*{path.suffix}"))
        raise FileNotFoundError(
            f"no llama-server reference {mine.name} for this machine's vector set "
            f"({native.vector_kernels()}; recorded: {', '.join(recorded) or 'none'}): record "
            "one here with the script its docstring names"
        )
    return json.loads(mine.read_text())
