"""Bad setting values are a ``ConfigError`` (exit status 2, one line naming the setting).

- ``log_level`` was a free string: ``--log-level verbose`` (or ``KVWARM_LOG_LEVEL=verbose``)
  crashed in ``logging.basicConfig`` with a traceback and exit status 1.
- Number settings took ``nan``: ``model_idle_unload_s=nan`` and ``keepalive_interval_s=nan``
  passed every ``< 0`` check, and the background loops' ``Event.wait(nan)`` returned at once,
  spinning a core for the server's whole life.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.cli.test_cli import clean_env

from kvwarm.errors import ConfigError
from kvwarm.settings import load_settings


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unknown_log_level_is_a_usage_error_not_a_traceback(tmp_path: Path, how: str) -> None:
    env = clean_env(tmp_path)
    args = [sys.executable, "-m", "kvwarm", "models"]
    if how == "flag":
        args += ["--log-level", "verbose"]
    else:
        env["KVWARM_LOG_LEVEL"] = "verbose"
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2, (result.returncode, result.stderr[-600:])
    assert "log_level" in result.stderr or "log-level" in result.stderr, result.stderr


def test_unknown_log_level_is_refused_by_load_settings() -> None:
    with pytest.raises(ConfigError, match="log"):
        load_settings({"log_level": "verbose"}, {})


@pytest.mark.parametrize("name", ["model_idle_unload_s", "keepalive_interval_s"])
def test_nan_seconds_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: "nan"}, {})


@pytest.mark.parametrize("name", ["request_timeout_s", "worker_stall_s"])
def test_negative_seconds_are_refused_not_read_as_off(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be >= 0"):
        load_settings({name: -1.0}, {})
