"""``/cache/stats`` reports each tier's effective quota and whether the room on its
filesystem capped it (a disk whose free space is below the configured quota)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready


def test_stats_say_when_the_filesystem_caps_a_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = 3 << 20
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)
    )
    settings = stub_settings(cache_dir=tmp_path, disk_quota_bytes=1 << 30)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        stats = client.get("/cache/stats").json()
    disk = stats["quotas"]["disk"]
    used = stats["counters"]["tier_disk_bytes"]
    assert disk == {
        "quota_bytes": 1 << 30,
        "effective_quota_bytes": used + free,
        "quota_capped_by_filesystem": True,
    }
    assert stats["quotas"]["ram"]["quota_capped_by_filesystem"] is False
    # The per-tier summary the dashboard and kvwarm cache stats read says the same.
    tier = stats["tiers"]["disk"]
    assert tier["quota_bytes"] == 1 << 30
    assert tier["effective_quota_bytes"] == used + free and tier["quota_capped_by_filesystem"]
    ram = stats["tiers"]["ram"]
    assert ram["effective_quota_bytes"] == ram["quota_bytes"]
