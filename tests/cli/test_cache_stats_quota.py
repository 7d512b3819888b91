"""``kvwarm cache stats`` prints a tier's effective quota: the configured one capped by the
room on its filesystem (``cache/store/quota.py``), the configured one beside it when they
differ (found by review: it printed the configured quota alone). In process, so the
filesystem's free space can be stood in for."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvwarm.cli import main

FREE = 3 << 20


def stats(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["cache", "stats", "--cache-dir", str(tmp_path / "kv"), "--disk-quota-bytes",
                 "1G", *extra])  # fmt: skip
    assert code == 0
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [k for k in os.environ if k.startswith("KVWARM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "kv" / "rows").mkdir(parents=True)


def test_a_quota_the_filesystem_caps_is_printed_effective_and_configured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=FREE // 4096, f_frsize=4096)
    )
    out = json.loads(stats(tmp_path, capsys, "--json"))
    disk = out["tiers"]["disk"]
    assert disk["quota_bytes"] == 1 << 30
    assert disk["effective_quota_bytes"] == disk["bytes"] + FREE
    assert disk["quota_capped_by_filesystem"] is True
    assert out["tiers"]["ram"]["effective_quota_bytes"] == out["tiers"]["ram"]["quota_bytes"]
    # No event counts of this process (restores ...): the server counts those.
    assert "restores" not in disk
    assert not [k for k in out["counters"] if k.endswith("_restores")]
    text = stats(tmp_path, capsys)
    (line,) = [ln for ln in text.splitlines() if ln.lstrip().startswith("disk ")]
    assert "quota 3.0 MiB (configured 1.0 GiB, capped by the free space)" in line


def test_a_quota_with_room_is_printed_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=(4 << 30) // 4096, f_frsize=4096)
    )
    text = stats(tmp_path, capsys)
    (line,) = [ln for ln in text.splitlines() if ln.lstrip().startswith("disk ")]
    assert line.endswith("quota 1.0 GiB")
