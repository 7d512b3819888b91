"""A config file with a ``[kvwarm]`` table *and* kvwarm settings beside it: each setting must
take effect or be a ``ConfigError``. Every top-level key used to be ignored silently once a
``[kvwarm]`` table existed, and in TOML a ``[[models]]`` array written after ``[kvwarm]`` is
top-level (``[[kvwarm.models]]`` is inside it): that natural file served the embedded model
instead of the one it named, with no error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwarm.errors import ConfigError
from kvwarm.settings import load_settings


def _load(path: Path) -> object:
    try:
        return load_settings({"config": str(path)}, {})
    except ConfigError:
        return None  # refused, naming the problem: fine


def test_models_after_a_kvwarm_table_are_not_silently_ignored(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[kvwarm]\nport = 9001\n\n[[models]]\nid = "m"\npath = "/srv/m.gguf"\n')
    settings = _load(path)
    if settings is not None:
        assert [m.model_id for m in settings.models] == ["m"], settings.models  # type: ignore[attr-defined]


@pytest.mark.parametrize("key,value,attr", [("n_ctx", "2048", 2048), ("port", "9002", 9002)])
def test_top_level_keys_beside_a_kvwarm_table_are_not_silently_ignored(
    tmp_path: Path, key: str, value: str, attr: int
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"{key} = {value}\n\n[kvwarm]\nmax_queue = 8\n")
    settings = _load(path)
    if settings is not None:
        assert getattr(settings, key) == attr


def test_a_kvwarm_table_inside_the_kvwarm_table_is_not_silently_ignored(tmp_path: Path) -> None:
    """Found by review: ``kvwarm`` was taken out of the unknown keys of the [kvwarm] table
    itself, so ``[kvwarm.kvwarm]`` (a section written twice) and its settings did nothing."""
    path = tmp_path / "config.toml"
    path.write_text("[kvwarm]\nmax_queue = 8\n\n[kvwarm.kvwarm]\nport = 9003\n")
    with pytest.raises(ConfigError, match="unknown settings kvwarm"):
        load_settings({"config": str(path)}, {})
