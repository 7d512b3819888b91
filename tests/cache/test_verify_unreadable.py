"""``verify`` reports every bad row and goes on: a row whose file can no longer be read at all
(here replaced by a socket after the startup scan adopted it: the open fails with ENXIO, a
``CacheIOError``, not a format error) used to stop the whole verify at that row."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig


def test_an_unreadable_row_is_reported_and_the_verify_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "rows"
    cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 20), TierConfig("disk", 1 << 22, root)))
    with Cache(cfg, background=False) as c:
        assert c.save(req((4,) * 8, tier="disk"), sync=True)
        assert c.save(req((5,) * 8, tier="disk"), sync=True)
    broken = Cache(cfg, background=False)
    with broken:
        key = broken.key_for(NS, (4,) * 8)
        path = root / f"{key.hex()}.kvc"
        os.unlink(path)
        with socket.socket(socket.AF_UNIX) as s:
            monkeypatch.chdir(root)  # a socket's path must be short: bind the bare name
            s.bind(path.name)
            report = broken.verify(repair=True)
    assert report.checked == 2
    assert [where for where, _ in report.bad] == [str(path)]
    assert "unreadable" in report.bad[0][1]
    assert path.exists()  # an I/O failure is reported, never repaired by deleting
