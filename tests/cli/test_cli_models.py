"""What a user of the command line sees about models: a server with no loadable model exits 1
with the reason, bad model settings exit 2, one-shot commands are quiet unless asked, the load
bar and llama.cpp's log lines (the real model where it matters)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from .test_cli import _free_port, clean_env, kvwarm, no_traceback


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment (no KVWARM_*; caches and config under tmp_path) and small settings."""
    return {**clean_env(tmp_path), "KVWARM_N_CTX": "1024", "KVWARM_N_BATCH": "64"}


def test_serve_exits_1_with_the_reason_when_no_model_loads(env: dict[str, str]) -> None:
    result = kvwarm(
        env, "serve", "--port", str(_free_port()), "--model", "m=/nonexistent/m.gguf", timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert (
        "kvwarm: error: no model could be loaded: m: ModelNotFoundError: "
        "model file not found: /nonexistent/m.gguf"
    ) in result.stderr
    no_traceback(result)


def test_serve_names_the_file_and_why_when_it_is_no_loadable_model(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A GGUF magic over a header cut short: the reason reaches the user (it was "loading
    ... failed or was cancelled", llama.cpp's reason lost)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\x07")
    result = kvwarm(env, "serve", "--port", str(_free_port()), "--model", f"m={bad}", timeout=120)
    assert result.returncode == 1, result.stderr
    assert (
        f"kvwarm: error: no model could be loaded: m: InvalidModelFileError: '{bad}' is not a "
        "readable GGUF file (its header is malformed or cut short): truncated header"
    ) in result.stderr
    no_traceback(result)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--n-gpu-layers=-3"], "--n-gpu-layers: expected a number of layers >= 0 or 'all'"),
        (["-ctv", "q4_0", "-fa", "off"], "a quantised V cache (type_v=q4_0) needs flash"),
        (["--deterministic", "-fa", "off"], "deterministic mode needs flash attention"),
        (["-ts", "0,0"], "tensor_split must give at least one GPU a share > 0"),
        (["--alias", "gpt-4o=nope"], "alias gpt-4o=nope: no model 'nope'"),
    ],
)
def test_bad_model_settings_exit_2_before_anything_loads(
    env: dict[str, str], args: list[str], needle: str
) -> None:
    result = kvwarm(env, "serve", "--port", str(_free_port()), *args, timeout=120)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    no_traceback(result)


def _interrupted_temp_file(env: dict[str, str]) -> Path:
    """A leftover temp file: a repairing open (``cache gc``) removes it and logs that at INFO."""
    rows = Path(env["XDG_CACHE_HOME"]) / "kvwarm" / "rows"
    rows.mkdir(mode=0o700, parents=True, exist_ok=True)  # as a server leaves it
    # pid 999999999 is above any pid_max: a writer that is gone, so its file is reaped.
    tmp = rows / f"{'ab' * 32}.kvc.999999999.2.3.tmp"
    tmp.write_bytes(b"partial")
    return tmp


def test_cache_commands_are_quiet_unless_verbose(env: dict[str, str]) -> None:
    tmp = _interrupted_temp_file(env)
    quiet = kvwarm(env, "cache", "gc")
    assert quiet.returncode == 0 and "removed 0 rows" in quiet.stdout
    assert quiet.stderr == "" and not tmp.exists()
    tmp = _interrupted_temp_file(env)
    loud = kvwarm(env, "cache", "gc", "-v")
    assert loud.returncode == 0
    assert re.search(r" INFO kvwarm\.cache.*removing interrupted temp file", loud.stderr)
    # An explicit log level from any source still applies.
    _interrupted_temp_file(env)
    configured = kvwarm({**env, "KVWARM_LOG_LEVEL": "info"}, "cache", "gc")
    assert " INFO " in configured.stderr


def test_stats_and_ls_inspect_without_changing_anything(env: dict[str, str]) -> None:
    # They opened the cache repairing: a look at a running server's directory reaped files
    # and registered as a second user of it (which sends the server's chunks to the sweep).
    tmp = _interrupted_temp_file(env)
    for command in ("stats", "ls"):
        result = kvwarm(env, "cache", command, "-v")
        assert result.returncode == 0, result.stderr
        # A read-only open: no reaping, and (FileTier registers only when repairing) no
        # registration as a user of the directory.
        assert tmp.exists() and "removing" not in result.stderr


@pytest.mark.model
def test_complete_without_a_terminal_shows_no_bar_and_no_n_ctx_train_warning(
    env: dict[str, str],
) -> None:
    # The defaults (n_ctx 4096 x 4 slots = 16384 cells > n_ctx_train 8192) used to warn.
    env = {k: v for k, v in env.items() if k not in ("KVWARM_N_CTX", "KVWARM_N_BATCH")}
    result = kvwarm(env, "complete", "Hi", "--max-tokens", "1")
    assert result.returncode == 0, result.stderr
    assert "n_ctx_train" not in result.stderr and "training context" not in result.stderr
    assert "loading" not in result.stderr and "\r" not in result.stderr  # stderr is a pipe
    assert result.stderr.startswith("prompt ")  # only the timing line


@pytest.mark.model
@pytest.mark.slow
def test_the_load_bar_reaches_100_percent_with_log_lines_above_it(env: dict[str, str]) -> None:
    """On a terminal the bar advances to 100% and a log line (here our own n_ctx warning)
    prints on a line of its own, not inside the bar."""
    master, slave = pty.openpty()
    # A terminal 100 columns wide (a fresh pty has 0, and tqdm then draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwarm", "complete", "Hi", "--max-tokens", "1", "-v",
         "--n-ctx", "9000"],
        env={**env, "TERM": "xterm", "KVWARM_N_PARALLEL": "1"},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
    )  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 300
    poller = select.poll()  # not select(): a long test run may hold fds above 1024
    poller.register(master, select.POLLIN)
    while time.monotonic() < deadline:  # read the terminal until the child closes it
        ready = poller.poll(1000)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode("utf-8", errors="replace")
    frames = re.split(r"[\r\n]", screen)
    percents = [int(m.group(1)) for f in frames if (m := re.search(r"loading \S+:\s+(\d+)%", f))]
    assert percents and percents[-1] == 100 and len(set(percents)) > 2, percents
    assert percents == sorted(percents)
    warning = [f for f in frames if "is more than the 8192 tokens it was trained on" in f]
    assert warning and all("%|" not in f for f in warning), warning


def test_models_scan_of_a_missing_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvwarm models --scan DIR`` with a typo'd DIR listed nothing from it and exited 0
    (found by review)."""
    from kvwarm.cli import main

    missing = tmp_path / "no-such-dir"
    assert main(["models", "--scan", str(missing)]) == 2
    assert capsys.readouterr().err == f"kvwarm: error: --scan {missing}: not a directory\n"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert main(["models", "--json", "--scan", str(tmp_path)]) == 0
    listed = [m for m in json.loads(capsys.readouterr().out) if m["source"].startswith("scan")]
    assert [m["id"] for m in listed] == ["m"]


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_the_servers_log_at_info_by_default(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``kvwarm cluster`` took ``-v`` and logged warnings only, as the
    one-shot commands do, while its help and docs/configuration.md say log_level's default
    is "info for serve and cluster"."""
    from kvwarm.cli import build_parser
    from kvwarm.cli.common import settings_from

    for name in list(os.environ):
        if name.startswith("KVWARM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = build_parser()
    assert settings_from(parser.parse_args([command])).log_level == "info"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "-v"])
