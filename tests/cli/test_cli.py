"""The ``kvwarm`` command line, end to end in subprocesses (the real embedded model)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import httpx
import pytest

from kvwarm.cli.misc import bench_script

SRC = Path(__file__).resolve().parents[2] / "src"
# Longer than the policy's 16-token minimum, so the prompt is saved.
LONG_PROMPT = "Here is a list of the largest cities in Europe, ordered by population, with notes:"


def clean_env(tmp_path: Path) -> dict[str, str]:
    """A child's environment: no KVWARM_* of ours, this checkout's ``src``, and caches and
    config under ``tmp_path``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_") and k != "PYTHONPATH"}
    out.update(
        PYTHONPATH=str(SRC),
        XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
    )
    return out


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    out = clean_env(tmp_path)
    out.update(
        KVWARM_N_CTX="1024",
        KVWARM_N_BATCH="64",
        KVWARM_POLICY_MIN_TOKENS="16",
        KVWARM_POLICY_COLD_MIN_TOKENS="16",
        KVWARM_POLICY_BOUNDARY_ALIGN_TOKENS="16",
        KVWARM_POLICY_BOUNDARY_TRIM_TOKENS="0",
    )
    return out


def kvwarm(
    env: dict[str, str], *args: str, stdin: str = "", timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvwarm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr


# --- usage -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["serve"],
        ["complete"],
        ["chat"],
        ["cache"],
        ["cache", "stats"],
        ["cache", "ls"],
        ["cache", "gc"],
        ["cache", "verify"],
        ["bench"],
        ["models"],
        ["cluster"],
    ],
)
def test_help_on_every_command(env: dict[str, str], command: list[str]) -> None:
    result = kvwarm(env, *command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kvwarm")


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-tokens", "-1"], "--max-tokens: max_tokens must be >= 0"),
        (["--temperature", "nan"], "--temperature: temperature must be a finite number"),
        (["--stop", ""], "--stop: "),
    ],
)
def test_a_sampling_flag_out_of_range_is_a_usage_error(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 as for a flag that is not a number (found by review: it was 1, a failure). The
    check runs before any model loads."""
    from kvwarm.cli import main

    argv = ["complete", "--backend", "stub", "--model", "stub-a", "--cache-dir", "none"]
    assert main([*argv, *flags, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvwarm: error: {said}") and err.count("\n") == 1, err


@pytest.mark.parametrize("grace", ["-1", "nan", "inf", "soon"])
def test_cache_gc_refuses_a_bad_grace_before_it_changes_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], grace: str
) -> None:
    """Found by review: ``gc --shared --grace-s -1`` opened the cache for repair first (its
    scan set damaged files aside, it registered in ``procs/``, ran the TTL sweep) and only
    then refused the grace; ``--grace-s`` without ``--shared`` was ignored without a word.
    Both are usage errors now, before the cache is opened."""
    from kvwarm.cli import main

    rows = tmp_path / "rows"
    rows.mkdir(mode=0o700)
    damaged = rows / f"{'ab' * 32}.kvc"
    damaged.write_bytes(b"garbage")
    argv = ["cache", "gc", "--cache-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--shared", "--grace-s", grace])
    assert exited.value.code == 2
    assert "argument --grace-s: " in capsys.readouterr().err
    assert main([*argv, "--grace-s", "60"]) == 2
    assert "--grace-s applies to the sweep of --shared" in capsys.readouterr().err
    assert damaged.exists() and not (rows / "quarantine").exists()
    assert main([*argv, "--shared", "--grace-s", "0"]) == 0
    assert not damaged.exists() and (rows / "quarantine" / damaged.name).exists()


def test_cache_gc_removes_the_rows_idle_past_their_ttl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: idle time counted no earlier than the cache's opening (so a server's
    restart after downtime expires nothing at once), which for ``kvwarm cache gc``, a process
    that has just opened it, meant no row could ever expire: "removed 0 rows", always. It
    counts from each row's last use; a row used within its TTL stays."""
    from tests.cache.facadekit import req

    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cache.formats import kvc
    from kvwarm.cli import main

    rows = tmp_path / "rows"
    config = CacheConfig(tiers=(TierConfig("disk", 1 << 30, rows),))
    fields = kvc.fields_from_request
    ago = time.time() - 10 * 86_400  # ten days: past every TTL class
    with monkeypatch.context() as m:
        m.setattr(kvc, "fields_from_request", lambda r, now: fields(r, now=ago))
        with Cache(config) as c:
            stale = c.save(req((1,) * 8, tier="disk"), sync=True)
    with Cache(config) as c:
        fresh = c.save(req((2,) * 8, tier="disk"), sync=True)
        assert c.gc().rows == 0  # a server's own sweep: idle time from its start
    assert stale is not None and fresh is not None
    assert main(["cache", "gc", "--json", "--cache-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1
    assert [p.name for p in rows.glob("*.kvc")] == [f"{fresh.hex()}.kvc"]


@pytest.mark.parametrize("command", [["verify", "--repair"], ["gc"]])
def test_cache_maintenance_evicts_no_sound_row_for_its_quota(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """Found by review: ``verify --repair`` and ``gc`` open the cache for repair, which
    enforced the quota their own settings gave (``--disk-quota-bytes``, or the 20 GiB default
    beside a server given more) and deleted sound rows down to it, reported nowhere."""
    from tests.cache.chunkkit import chunked_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cli import main

    rows = tmp_path / "rows"
    with Cache(CacheConfig(tiers=(TierConfig("disk", 1 << 30, rows),))) as c:
        for start in range(3):
            assert c.save(chunked_request(NS, range(start, start + 300), tier="disk"), sync=True)
    before = sorted(p.name for p in rows.glob("*.kv?"))
    (rows / f"{'ab' * 32}.kvc").write_bytes(b"garbage")  # what makes verify --repair repair
    argv = ["cache", *command, "--cache-dir", str(tmp_path), "--disk-quota-bytes", "100000"]
    assert main(argv) == (1 if command[0] == "verify" else 0)
    capsys.readouterr()
    assert sorted(p.name for p in rows.glob("*.kv?")) == before  # the garbage set aside
    assert (rows / "quarantine" / f"{'ab' * 32}.kvc").exists()


def test_cache_gc_leaves_a_lone_server_deleting_its_evicted_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: ``kvwarm cache gc`` registered in ``procs/`` as a co-tenant, so a
    server alone in the directory counted as co-tenanted from then on until it stopped: its
    evictions only forgot their chunks (left on disk, over its quota, for the hourly sweep).
    A maintenance command writes no row; it registers as such, and the server is not told."""
    from tests.cache.chunkkit import chunked_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cli import main

    rows = tmp_path / "rows"
    with Cache(CacheConfig(tiers=(TierConfig("disk", 1 << 30, rows),)), background=False) as server:
        assert server.save(chunked_request(NS, range(600), tier="disk"), sync=True)
        assert main(["cache", "gc", "--cache-dir", str(tmp_path)]) == 0
        capsys.readouterr()
        assert server.evict_bytes(1 << 40).rows == 1
        assert not list(rows.glob("*.kv?"))  # its chunks deleted with their last row


@pytest.mark.parametrize("limit", ["-3", "0"])
def test_cache_ls_refuses_a_limit_below_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    """``--limit -3`` listed every row without a word (found by review); ``--limit 0`` meant
    all rows, where ``GET /cache/rows?limit=0`` meant none: both refuse it now, saying how
    to list every row."""
    from kvwarm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["cache", "ls", "--limit", limit, "--cache-dir", str(tmp_path)])
    assert exited.value.code == 2
    said = f"argument --limit: must be 1 or more (leave --limit out for every row), got {limit}"
    assert said in capsys.readouterr().err
    assert main(["cache", "ls", "--json", "--cache-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["cache", "ls", "--json", "--limit", "1", "--cache-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_serve_on_a_taken_port_exits_1_with_one_line(env: dict[str, str]) -> None:
    """uvicorn exits 3 when it cannot bind and says why only in its log (found by review: the
    CLI's failure status is 1, and its last line said nothing)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = kvwarm(env, "serve", "--port", port, "--backend", "stub", "--model", "stub-a",
                        "--cache-dir", "none", timeout=120)  # fmt: skip
    assert result.returncode == 1, result.stderr
    no_traceback(result)
    assert "address already in use" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"kvwarm: error: cannot serve on 127.0.0.1:{port} (the reason is logged above)"


def test_serve_help_names_every_route_family(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvwarm serve --help`` listed the routes it serves, and missed /v1/messages,
    /v1/responses, the rerank routes, /infill and /lora-adapters (found by review). Every
    route of /openapi.json must be named, by its family (/v1/NAME, /admin/NAME, /cache/*)."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import stub_settings

    from kvwarm.cli import main
    from kvwarm.server import create_app

    monkeypatch.setenv("COLUMNS", "10000")  # argparse breaks lines after a hyphen
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out

    def family(path: str) -> str:
        parts = path.split("/")
        if parts[1] == "cache":
            return "/cache/*"
        return "/".join(parts[:3] if parts[1] in ("v1", "v2", "admin") else parts[:2])

    paths = TestClient(create_app(stub_settings())).get("/openapi.json").json()["paths"]
    families = {family(p) for p in paths} - {"/cluster"}  # kvwarm cluster's alone
    assert {f for f in families if f not in text} == set()


def test_admin_key_help_names_every_admin_route() -> None:
    """--admin-key's help named /cache/* and /admin/* only (found by review): POST
    /lora-adapters and /cluster need the key too (server/guard.py)."""
    from kvwarm.server.guard import ADMIN_PREFIXES, ADMIN_ROUTES
    from kvwarm.settings import Settings

    text = Settings.model_fields["admin_key"].description or ""
    named = [p.rstrip("/") + ("/*" if p.endswith("/") else "") for p in ADMIN_PREFIXES]
    named += [f"{method} {path}" for method, path in sorted(ADMIN_ROUTES)]
    assert [n for n in named if n not in text] == []


def test_usage_errors_exit_2(env: dict[str, str]) -> None:
    assert kvwarm(env).returncode == 2
    assert kvwarm(env, "frobnicate").returncode == 2
    bad_flag = kvwarm(env, "complete", "--no-such-flag", "x")
    assert bad_flag.returncode == 2
    bad_value = kvwarm(env, "complete", "--n-ctx", "lots", "x")
    assert bad_value.returncode == 2
    assert bad_value.stderr.strip() == (
        "kvwarm: error: flag setting --n-ctx: expected an integer, got 'lots'"
    )
    bad_env = kvwarm({**env, "KVWARM_PORT": "eighty"}, "cache", "stats")
    assert bad_env.returncode == 2 and "port" in bad_env.stderr
    no_traceback(bad_env)


def test_runtime_errors_exit_1_without_traceback(env: dict[str, str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    result = kvwarm(env, "complete", "--model", str(missing), "hello")
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"model file not found: {missing}")
    no_traceback(result)


# --- generation ------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_complete_prints_text_and_timings_and_reuses_the_disk_cache(env: dict[str, str]) -> None:
    args = ("complete", LONG_PROMPT, "--max-tokens", "4", "--temperature", "0")
    first = kvwarm(env, *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    timing = re.search(r"prompt (\d+) tokens \((\d+) from cache", first.stderr)
    assert timing is not None, first.stderr
    assert "tok/s" in first.stderr and "finish " in first.stderr
    second = kvwarm(env, *args)  # a new process: only the disk tier can make this warm
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout  # greedy
    warm = re.search(r"prompt (\d+) tokens \((\d+) from cache", second.stderr)
    assert warm is not None and int(warm.group(2)) > 0, second.stderr


@pytest.mark.model
@pytest.mark.slow
def test_chat_repl_streams_and_reports_cache_use_per_turn(env: dict[str, str]) -> None:
    result = kvwarm(
        env,
        "chat", "--system", "You are terse.", "--max-tokens", "5", "--temperature", "0",
        stdin="Hello!\n\nWhat is two plus two?\n/exit\nnever read\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    turns = re.findall(r"\[turn (\d): cached (\d+)/(\d+) prompt tokens", result.stderr)
    assert [t[0] for t in turns] == ["1", "2"], result.stderr
    cached_2, prompt_2 = int(turns[1][1]), int(turns[1][2])
    prompt_1 = int(turns[0][2])
    # The second turn re-sends the first: its prompt comes (mostly) from the cache.
    assert cached_2 >= prompt_1 - 16 and cached_2 < prompt_2
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 1


@pytest.mark.model
@pytest.mark.slow
def test_a_refused_chat_turn_is_reported_and_the_chat_goes_on(env: dict[str, str]) -> None:
    """Found by review: a turn the model refused (here one longer than the context) ended the
    chat with exit status 1, the conversation lost. It is reported and left out of the
    conversation; the next turn is answered, and the exit status still says one failed."""
    too_long = "word " * 1500  # past the fixture's 1,024-token context
    result = kvwarm(
        env,
        "chat", "--max-tokens", "3", "--temperature", "0",
        stdin=f"Hello!\n{too_long}\nWhat is two plus two?\n",
    )  # fmt: skip
    no_traceback(result)
    assert result.returncode == 1, result.stderr
    assert "context holds 1024" in result.stderr and "not sent" in result.stderr
    turns = re.findall(r"\[turn (\d): cached (\d+)/(\d+) prompt tokens", result.stderr)
    assert [t[0] for t in turns] == ["1", "2"], result.stderr
    # The refused message is not part of the conversation the second turn sends.
    assert int(turns[1][2]) < 200, turns


# --- cache maintenance (the model fills the cache; the commands run without it) -----------


@pytest.mark.model
@pytest.mark.slow
def test_cache_commands_and_verify_finds_corruption(env: dict[str, str]) -> None:
    filled = kvwarm(env, "complete", LONG_PROMPT, "--max-tokens", "4")
    assert filled.returncode == 0, filled.stderr
    # From here on no model is involved: the cache is pure Python.
    env_no_model = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    stats = kvwarm(env_no_model, "cache", "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    summary = json.loads(stats.stdout)
    assert summary["rows"] >= 1 and summary["cache_dir"].endswith("kvwarm")
    ls = kvwarm(env_no_model, "cache", "ls")
    assert ls.returncode == 0 and len(ls.stdout.splitlines()) == summary["rows"] + 1
    rows = json.loads(kvwarm(env_no_model, "cache", "ls", "--json").stdout)
    assert {r["tier"] for r in rows} == {"disk"}
    ok = kvwarm(env_no_model, "cache", "verify")
    assert ok.returncode == 0 and f"checked {summary['rows']} rows: 0 bad" in ok.stdout
    victim = sorted(Path(env["XDG_CACHE_HOME"]).rglob("*.kvc"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the payload: only the CRC can tell
    victim.write_bytes(bytes(data))
    bad = kvwarm(env_no_model, "cache", "verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "1 bad" in bad.stdout and "bad:" in bad.stderr
    no_traceback(bad)
    gc = kvwarm(env_no_model, "cache", "gc", "--json")
    assert gc.returncode == 0 and set(json.loads(gc.stdout)) == {"rows", "bytes"}


def test_a_tier_configured_by_url_is_seen_by_every_command_that_opens_the_cache(
    env: dict[str, str], tmp_path: Path
) -> None:
    extra = f"extra=file://{tmp_path / 'extra'}?quota=1G"
    filled = kvwarm(
        env, "complete", LONG_PROMPT, "--max-tokens", "4", "--tiers", extra, "--save-tier", "extra"
    )
    assert filled.returncode == 0, filled.stderr
    env_no_model = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    rows = json.loads(kvwarm(env_no_model, "cache", "ls", "--json", "--tiers", extra).stdout)
    assert rows and {r["tier"] for r in rows} == {"extra"}
    # Without the flag the command does not open that directory: none of its rows.
    assert json.loads(kvwarm(env_no_model, "cache", "ls", "--json").stdout) == []
    ok = kvwarm(env_no_model, "cache", "verify", "--tiers", extra)
    assert ok.returncode == 0 and f"checked {len(rows)} rows: 0 bad" in ok.stdout, ok.stdout


def test_cache_verify_reports_every_bad_file_and_repairs_only_when_asked(
    env: dict[str, str],
) -> None:
    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cache.types import Namespace, SaveReason, SaveRequest

    root = Path(env["XDG_CACHE_HOME"]) / "kvwarm" / "rows"
    ns = Namespace(b"\x01" * 32, 0, b"\x02" * 32)
    with Cache(CacheConfig(tiers=(TierConfig("disk", 1 << 20, root),)), background=False) as c:
        for t in (1, 2, 3):
            request = SaveRequest(ns, (t,) * 8, b"kv" * 50, SaveReason.COLD, "disk")
            assert c.save(request, sync=True)
    _, truncated, flipped = sorted(root.glob("*.kvc"))
    truncated.write_bytes(truncated.read_bytes()[:40])
    data = bytearray(flipped.read_bytes())
    data[-20] ^= 0xFF  # inside the payload: only the CRC can tell
    flipped.write_bytes(bytes(data))
    garbage = root / ("ab" * 32 + ".kvc")
    garbage.write_bytes(b"garbage")
    env_no_model = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    listing = sorted(p.name for p in root.iterdir())
    for _ in range(2):  # reporting is repeatable: the first run repaired nothing
        result = kvwarm(env_no_model, "cache", "verify", "--json")
        assert result.returncode == 1, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert sorted(b["row"] for b in report["bad"]) == sorted(
            map(str, (truncated, flipped, garbage))
        )
        assert report["checked"] == 4
        assert sorted(p.name for p in root.iterdir()) == listing
    repaired = kvwarm(env_no_model, "cache", "verify", "--repair")
    assert repaired.returncode == 1 and "3 bad" in repaired.stdout
    no_traceback(repaired)
    assert sorted(p.name for p in (root / "quarantine").iterdir()) == sorted(
        p.name for p in (truncated, garbage)
    )
    after = kvwarm(env_no_model, "cache", "verify")
    assert after.returncode == 0 and "checked 1 rows: 0 bad" in after.stdout


def test_cache_verify_counts_what_the_startup_scan_fixed_and_exits_0(
    env: dict[str, str],
) -> None:
    """A server restarted over damaged files (a truncated chunk, a flipped trailer byte, a
    manifest with 70 bytes appended) set them aside at startup, with the manifests whose
    chunks they were; verify then finds what remains sound and says what was fixed."""
    from tests.cache.test_startup_damage import config, damage

    from kvwarm.cache import Cache

    root = Path(env["XDG_CACHE_HOME"]) / "kvwarm" / "rows"
    damage(root)
    Cache(config(root), background=False).close()  # the restart's startup scan
    env_no_model = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    result = kvwarm(env_no_model, "cache", "verify", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report == {
        "checked": 1,
        "bad": [],
        "quarantined": {"rows": 4, "chunks": 2},
        "missing_dirs": [],
    }
    text = kvwarm(env_no_model, "cache", "verify")
    assert text.returncode == 0, text.stdout + text.stderr
    assert "checked 1 rows: 0 bad" in text.stdout
    assert "4 row files, 2 chunk files" in text.stdout
    no_traceback(text)


# --- models, bench, serve --------------------------------------------------------------------


@pytest.mark.model  # asserts the embedded model is installed
def test_models_lists_the_embedded_default(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "extra.gguf").write_bytes(b"GGUF")
    result = kvwarm(env, "models", "--json", "--scan", str(tmp_path))
    assert result.returncode == 0, result.stderr
    found = {m["id"]: m for m in json.loads(result.stdout)}
    assert found["smollm2-135m-instruct"]["source"] == "embedded"
    assert found["smollm2-135m-instruct"]["available"] is True
    assert found["extra"]["available"] is True
    text = kvwarm(env, "models")
    assert text.returncode == 0 and "smollm2-135m-instruct" in text.stdout


def test_bench_runs_the_script_and_passes_its_exit_code(
    env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "fake_bench.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    result = kvwarm(env, "bench", "--script", str(script), "--", "--runs", "2")
    assert result.returncode == 3
    assert "args ['--runs', '2']" in result.stdout
    missing = kvwarm(env, "bench", "--script", str(tmp_path / "nope.py"))
    assert missing.returncode == 1 and "not found" in missing.stderr
    assert bench_script() == SRC.parent / "bench" / "cold_warm.py"


def test_bench_passes_the_scripts_options_without_a_double_dash(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Its help says the arguments after 'bench' go to the script, whose arguments are all
    options: ``kvwarm bench --lengths 128`` was a usage error (found by review)."""
    script = tmp_path / "fake_bench.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\n")
    ran = kvwarm(env, "bench", "--script", str(script), "--lengths", "128", "--matrix-only")
    assert ran.returncode == 0, ran.stderr
    assert "args ['--lengths', '128', '--matrix-only']" in ran.stdout
    equals = kvwarm(env, "bench", f"--script={script}", "--matrix-only")
    assert "args ['--matrix-only']" in equals.stdout
    its_help = kvwarm(env, "bench", "--script", str(script), "--", "--help")
    assert "args ['--help']" in its_help.stdout
    own = kvwarm(env, "bench", "--help")  # kvwarm's own help of the command
    assert own.returncode == 0 and own.stdout.startswith("usage: kvwarm bench")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.model
def _wait_healthy(proc: subprocess.Popen[str], base: str, deadline_s: float) -> bool:
    """Poll ``/health`` until 200 while ``proc`` lives (bounded readiness wait, not a
    sleep-as-sync); True once it answered 200."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_serve_answers_then_stops_on_sigterm(env: dict[str, str]) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwarm", "serve", "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_healthy(proc, base, 120), "server did not become ready"
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        response = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "smollm2-135m-instruct"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "completion model=smollm2-135m-instruct prompt_tokens=" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_cluster_serves_through_ray_then_stops_on_sigterm(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The stub backend on one replica: the command a user runs, start to clean exit."""
    import shutil
    import tempfile

    port = _free_port()
    ray_tmp = Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp"))  # short: Ray's socket paths
    env = {**env, "RAY_TMPDIR": str(ray_tmp), "KVWARM_BACKEND": "stub"}
    args = ["cluster", "--port", str(port), "--replicas", "1", "--model", "a=stub-a"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwarm", *args, "--cache-dir", "none"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    banner = f"kvwarm cluster: http://127.0.0.1:{port}"
    out, err = _Lines(proc.stdout, banner), _Lines(proc.stderr)
    try:
        base = f"http://127.0.0.1:{port}"
        # Serve's proxy may answer before its deploy returns; a stop then (as the command
        # promises) stops it unannounced, so the request waits for the banner, which says the
        # deploy returned.
        if not _wait_healthy(proc, base, 240) or not out.seen.wait(240):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            code = proc.returncode
            pytest.fail(f"the cluster did not become ready (exit {code}):\n{err.text()[-6000:]}")
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "a"
        assert response.headers["x-kvwarm-replica"].startswith("SERVE_REPLICA::kvwarm#engine#")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        out.thread.join(30)
        err.thread.join(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, err.text()
    assert banner in out.text()
    assert "Traceback" not in err.text()


class _Lines:
    """A child's pipe read to its end on a thread of its own; ``seen`` is set once a line
    holds ``wanted``."""

    def __init__(self, pipe: IO[str] | None, wanted: str | None = None) -> None:
        assert pipe is not None
        self.lines: list[str] = []
        self.seen = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(pipe, wanted), daemon=True)
        self.thread.start()

    def _read(self, pipe: IO[str], wanted: str | None) -> None:
        for line in pipe:
            self.lines.append(line)
            if wanted is not None and wanted in line:
                self.seen.set()

    def text(self) -> str:
        return "".join(self.lines)


def test_cache_gc_shared_sweeps_unreferenced_chunks_of_a_shared_dir(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``kvwarm cache gc --shared``: chunks no row names and past the grace period go; the
    chunks a row names stay (no model: stub-shaped rows written through the library)."""
    from tests.cache.chunkkit import chunked_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cache.formats.key import cache_key

    cache_dir = tmp_path / "nfs"
    tiers = (
        TierConfig("ram", 1 << 30),
        TierConfig("disk", 1 << 30, cache_dir / "rows", shared=True),
    )
    with Cache(CacheConfig(tiers=tiers, chunk_tokens=16), background=False) as c:
        assert c.save(chunked_request(NS, tuple(range(64)), tier="disk"), sync=True)
        assert c.save(chunked_request(NS, tuple(range(48)) + (9,) * 16, tier="disk"), sync=True)
    (cache_dir / "rows" / (cache_key(NS, tuple(range(64))).hex() + ".kvc")).unlink()
    chunks = sorted((cache_dir / "rows").glob("*.kvk"))
    assert len(chunks) == 5
    for path in chunks:
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    env_shared = {
        **env,
        "KVWARM_MODELS": "/nonexistent/model.gguf",
        "KVWARM_CACHE_DIR": str(cache_dir),
        "KVWARM_CACHE_DIR_SHARED": "true",
    }
    young = kvwarm(env_shared, "cache", "gc", "--shared", "--json")  # default grace: 1 h
    no_traceback(young)
    assert young.returncode == 0, young.stderr
    [disk] = [s for s in json.loads(young.stdout)["shared"] if s["tier"] == "disk"]
    assert (disk["chunks"], disk["deleted"]) == (5, 1)  # the orphan, 2 h old
    assert len(list((cache_dir / "rows").glob("*.kvk"))) == 4
    again = kvwarm(env_shared, "cache", "gc", "--shared", "--grace-s", "0")
    assert again.returncode == 0 and "disk: 0 of 4 chunks swept" in again.stdout, again.stdout


def test_cache_stats_gives_stored_and_logical_bytes_per_memory_kind(
    env: dict[str, str], tmp_path: Path
) -> None:
    """No model: a sliding-window model's checkpoints and a full-attention row written through
    the library; ``kvwarm cache stats`` reports each kind's stored and logical bytes."""
    from dataclasses import replace

    from tests.cache.chunkkit import chunked_request, window_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig

    cache_dir = tmp_path / "kv"
    tiers = (TierConfig("disk", 1 << 30, cache_dir / "rows"),)
    with Cache(CacheConfig(tiers=tiers), background=False) as c:
        for n in (600, 650, 700):
            req = replace(window_request(NS, range(n), [], tier="disk"), memory="swa")
            assert c.save(req, sync=True)
        req = replace(chunked_request(NS, (7,) * 300, tier="disk"), memory="full")
        assert c.save(req, sync=True)
    env_dir = {
        **env,
        "KVWARM_MODELS": "/nonexistent/model.gguf",
        "KVWARM_CACHE_DIR": str(cache_dir),
    }
    stats = kvwarm(env_dir, "cache", "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    kinds = json.loads(stats.stdout)["memory_kinds"]
    assert {k: v["rows"] for k, v in kinds.items()} == {"swa": 3, "full": 1}
    assert kinds["swa"]["logical_bytes"] > 2 * kinds["swa"]["bytes"]  # windows stored once
    text = kvwarm(env_dir, "cache", "stats")
    assert text.returncode == 0 and "memory swa" in text.stdout and "memory full" in text.stdout


def test_read_only_cache_commands_create_and_chmod_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``stats``, ``ls`` and ``verify`` change nothing (operations.md): they used to create a
    missing cache directory, and tighten an existing one and its parent. A cache directory
    that exists without its ``rows/`` is an empty cache; ``gc`` leaves it so."""
    missing = tmp_path / "kv"
    missing.mkdir()
    env_missing = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    env_missing["KVWARM_CACHE_DIR"] = str(missing)
    for action in ("stats", "ls", "verify", "gc"):
        result = kvwarm(env_missing, "cache", action, "--json")
        no_traceback(result)
        assert result.returncode == 0, result.stderr
        assert f"{missing / 'rows'} does not exist" in result.stderr
        assert list(missing.iterdir()) == []
        if action in ("stats", "verify"):
            assert json.loads(result.stdout)["missing_dirs"] == [str(missing / "rows")]
    assert json.loads(kvwarm(env_missing, "cache", "ls", "--json").stdout) == []
    opened = tmp_path / "open"
    (opened / "rows").mkdir(parents=True)
    opened.chmod(0o777)
    (opened / "rows").chmod(0o755)
    env_open = {**env_missing, "KVWARM_CACHE_DIR": str(opened)}
    for action in ("stats", "ls", "verify"):
        result = kvwarm(env_open, "cache", action)
        assert result.returncode == 0, result.stderr
    modes = [os.stat(p).st_mode & 0o777 for p in (opened, opened / "rows")]
    assert modes == [0o777, 0o755]


def test_cache_commands_refuse_a_cache_dir_that_does_not_exist(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A maintenance command given a typo says so (exit 2, one line) and creates nothing:
    ``gc`` used to create the mistyped directory, the others to report an empty cache."""
    typo = tmp_path / "nowhere" / "kv"
    env_typo = {**env, "KVWARM_MODELS": "/nonexistent/model.gguf"}
    for action in ("gc", "stats", "ls", "verify", "explain"):
        args = ["cache", action, "--cache-dir", str(typo)]
        if action == "explain":
            args += ["--backend", "stub", "--model", "stub-a", "hello"]
        elif action == "verify":
            args.append("--repair")
        result = kvwarm(env_typo, *args)
        no_traceback(result)
        assert result.returncode == 2, (action, result.stderr)
        assert result.stderr.strip() == (
            f"kvwarm: error: cache_dir {typo} does not exist (kvwarm cache creates nothing; "
            "kvwarm serve creates it)"
        ), action
        assert not (tmp_path / "nowhere").exists(), action
    shm = kvwarm(env_typo, "cache", "gc", "--cache-dir", "none", "--shm-dir", str(typo))
    assert shm.returncode == 2 and f"shm_dir {typo} does not exist" in shm.stderr
    assert not (tmp_path / "nowhere").exists()
    # The default cache_dir, which nobody typed, is a cache not served yet: empty, uncreated.
    default = Path(env_typo["XDG_CACHE_HOME"]) / "kvwarm"
    assert not default.exists()
    for action in ("gc", "stats"):
        fresh = kvwarm(env_typo, "cache", action)
        assert fresh.returncode == 0, fresh.stderr
        assert f"{default / 'rows'} does not exist" in fresh.stderr
    assert not default.exists()


# A stub whose every forward pass takes two minutes: a worker stuck in native code.
_STUCK_SERVE = """
import os
import sys
os.environ["KVWARM_STUB_DECODE_DELAY_S"] = "120"  # read by StubBackend.from_env
from kvwarm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_signal_stops_serve_at_once(env: dict[str, str], tmp_path: Path) -> None:
    """uvicorn forced only on a second SIGINT, and only its wait for open connections: with a
    worker stuck in a forward pass, two SIGTERMs (or two Ctrl-C) left kvwarm serve waiting
    for the engine's shutdown (30 s per stuck model) regardless."""
    port = _free_port()
    args = ["serve", "--port", str(port), "--backend", "stub", "--model", "a=stub-a"]
    args += ["--cache-dir", str(tmp_path / "cache"), "--worker-stall-s", "0.01"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_SERVE, *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    shutting_down = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Shutting down" in line:
                shutting_down.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(proc, base, 60), "server did not become ready"
        body = {"prompt": "Hello", "max_tokens": 2}

        def ask() -> None:
            with contextlib.suppress(httpx.TransportError):  # the server goes away mid-request
                httpx.post(base + "/v1/completions", json=body, timeout=200)

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        deadline = time.monotonic() + 30  # bounded readiness poll: the worker is in its pass
        while "stalled" not in httpx.get(base + "/health", timeout=5).json():
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert shutting_down.wait(30), "the first signal started no shutdown"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
