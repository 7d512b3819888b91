"""A verify whose cache could not scan a tier whole says so: found by review, a store that was
down (a redis or s3 tier) or a scan out of file descriptors left the tier's rows unindexed,
and ``verify`` checked the others, reported ``0 bad`` and ``kvwarm cache verify`` exited 0,
"all is well" over rows it never saw (docs/operations.md: a store that is down is reported
as ``unreadable``). The tier is reported until a scan of it completes (a server's rescan)."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.test_scan_local_faults import config, failing, saved
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cli import main


def test_a_scan_out_of_descriptors_is_reported_by_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "rows"
    saved(root, 3)
    failing(monkeypatch, errno.EMFILE, lambda name: name.endswith(".kvc"))
    with Cache(config(root), background=False, repair=False) as cache:
        report = cache.verify()
    assert [where for where, _ in report.bad] == ["disk"]
    (why,) = [why for _, why in report.bad]
    assert why.startswith("unreadable: the scan stopped early") and "Too many open files" in why


def test_a_store_that_is_down_fails_the_verify_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as closed:  # bound, never listening: every connection is refused
        closed.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{closed.getsockname()[1]}/0?timeout_s=0.5"
        rc = main(["cache", "verify", "--json", "--tiers", f"r={url}"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert [b["row"] for b in out["bad"]] == ["r"]


def test_a_rescan_that_completes_clears_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "nfs"
    with Cache(config(root), background=False) as writer:
        assert writer.save(chunked_request(NS, list(range(600)), tier="disk"), sync=True)
    tiers = (TierConfig("disk", 1 << 30, root, shared=True),)
    failing(monkeypatch, errno.EMFILE, lambda name: name.endswith(".kvc"))
    with Cache(CacheConfig(tiers=tiers, chunk_tokens=256), background=False) as cache:
        assert [where for where, _ in cache.verify().bad] == ["disk"]
        monkeypatch.undo()
        assert cache.rescan() == 1
        report = cache.verify()
        assert report.bad == () and report.checked == 1
