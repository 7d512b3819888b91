"""True sizes (issue 25): ``/cache/stats``, ``/metrics``, ``kvwarm cache stats`` and the files
on disk agree, and a row reports the KV it restores and the bytes only it holds."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cli import main
from kvwarm.server import create_app

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


def _files(root: Path) -> tuple[int, int, int]:
    """(bytes, rows, chunks) of the tier directory: the files' apparent sizes, ``du -b``."""
    n_bytes = rows = chunks = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            n_bytes += os.stat(os.path.join(dirpath, name)).st_size
            rows += name.endswith(".kvc")
            chunks += name.endswith(".kvk")
    return n_bytes, rows, chunks


def _metric(text: str, name: str, tier: str) -> float:
    match = re.search(rf'^{name}\{{tier="{tier}"\}} (\S+)$', text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_sizes_agree_with_the_files_on_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = stub_settings(cache_dir=tmp_path, save_tier="disk", cache_chunk_tokens=64)
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        keys = []
        for question in ("What is a cache?", "Why is the sky blue?", "Name a prime number."):
            body = {"model": "a", "prompt": SYSTEM + question, "max_tokens": 2, "temperature": 0}
            response = c.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            keys.append(response.json()["timings"]["cache_key"])
        assert c.app.state.kvwarm.require_engine().cache.flush()
        stats = c.get("/cache/stats").json()
        metrics = c.get("/metrics").text
        rows = {r["key"]: r for r in c.get("/cache/rows").json()["data"]}
        row = c.get(f"/cache/rows/{keys[0]}").json()

    on_disk, n_rows, n_chunks = _files(tmp_path / "rows")
    disk = stats["tiers"]["disk"]
    assert n_chunks > 0 and (disk["rows"], disk["chunks"]) == (n_rows, n_chunks)
    assert disk["bytes"] == on_disk  # physical: manifests + each chunk once
    assert stats["bytes"] == on_disk and stats["rows"] == n_rows
    assert _metric(metrics, "kvwarm_cache_tier_bytes", "disk") == on_disk
    assert _metric(metrics, "kvwarm_cache_tier_chunks", "disk") == n_chunks
    logical = sum(r["bytes"] for r in rows.values())
    assert disk["logical_bytes"] == logical > on_disk  # the system prompt's chunks are shared
    assert _metric(metrics, "kvwarm_cache_tier_logical_bytes", "disk") == logical
    assert disk["dedup_ratio"] == pytest.approx(logical / on_disk, abs=1e-4) and logical > on_disk
    # A row restores its own file and every chunk it names; only the chunks past the shared
    # system prompt are its alone.
    assert row == rows[keys[0]]
    assert row["own_bytes"] < row["exclusive_bytes"] < row["bytes"]

    # The CLI over the same directory, no model loaded: the same numbers.
    capsys.readouterr()
    assert main(["cache", "stats", "--json", "--cache-dir", str(tmp_path)]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["tiers"]["disk"]["bytes"] == on_disk == cli["bytes"]
    assert cli["tiers"]["disk"]["logical_bytes"] == logical
    assert cli["tiers"]["disk"]["chunks"] == n_chunks
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"rows: {n_rows}  stored: " in text and f"chunks: {n_chunks}" in text
    assert main(["cache", "ls", "--json", "--cache-dir", str(tmp_path)]) == 0
    listed = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert {k: (r["bytes"], r["exclusive_bytes"]) for k, r in listed.items()} == {
        k: (r["bytes"], r["exclusive_bytes"]) for k, r in rows.items()
    }


def test_cache_stats_reports_no_request_counters_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvwarm cache stats`` printed ``Cache.counters()`` whole (found by review): the hits,
    misses and saves of its own read-only open, all 0 beside a server that counted them. It
    reports the levels the tiers hold, which equal the server's."""
    settings = stub_settings(cache_dir=tmp_path, save_tier="disk")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        body = {"model": "a", "prompt": SYSTEM, "max_tokens": 2}
        for _ in range(2):
            assert client.post("/v1/completions", json=body).status_code == 200
        assert client.app.state.kvwarm.require_engine().cache.flush()
        served = client.get("/cache/stats").json()["counters"]
    assert served["misses"] + served["hits_live"] + served["hits_exact"] == 2
    capsys.readouterr()
    assert main(["cache", "stats", "--json", "--cache-dir", str(tmp_path)]) == 0
    cli = json.loads(capsys.readouterr().out)["counters"]
    events = ("misses", "hits_exact", "hits_live", "saves_finish", "latency_save_count")
    assert not set(events) & set(cli), cli
    assert cli["tier_disk_rows"] == served["tier_disk_rows"] >= 1
    assert cli["tier_disk_bytes"] == served["tier_disk_bytes"]
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "misses" not in out.out and "hits_exact" not in out.out
    assert "tier_disk_rows" in out.out and "counted by the server" in out.err


def test_cache_stats_lists_a_tier_whose_directory_is_missing_as_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """operations.md: a missing tier directory is "counted as empty". ``cache stats`` dropped
    the tier from its listing instead (found by review: ``tiers`` had no ``disk`` at all, and
    the server's /cache/stats lists every configured tier), so a script reading
    ``tiers.disk`` failed exactly when the cache was empty."""
    cache_dir = tmp_path / "never-served"
    cache_dir.mkdir()  # a named one that does not exist is a typo: exit 2 (test_cli.py)
    missing = cache_dir / "rows"
    assert main(["cache", "stats", "--json", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.out)
    assert list(stats["tiers"]) == ["ram", "disk"]  # the server's order
    disk = stats["tiers"]["disk"]
    assert (disk["rows"], disk["bytes"], disk["quota_bytes"]) == (0, 0, 20 << 30)
    assert stats["missing_dirs"] == [str(missing)] and "does not exist" in out.err
    assert not missing.exists()
