"""kill -9 a writer process after every step of the publish protocol, then restart.

After a restart (scan): every acknowledged row is present and intact, the interrupted row is
either absent or complete (complete exactly when the kill came after the link), nothing
half-written is visible, no temp file remains, and a new writer can save the row again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import data_names, request, shm_dir
from tests.faults.writer_child import row

import kvwarm
from kvwarm.cache.tiers.files import PUBLISH_STEPS, FileTier

CHILD = Path(__file__).with_name("writer_child.py")
SRC = str(Path(kvwarm.__file__).resolve().parents[1])
STEPS = list(PUBLISH_STEPS)
VISIBLE_FROM = STEPS.index("linked")
N_ACKED = 3


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC}


def killed(*args: str) -> tuple[list[str], list[bytes]]:
    """Run the writer child with ``args`` until it kills itself at its step: its output's
    lines and the keys it acknowledged, in order (it must have died by SIGKILL, not
    survived its step)."""
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lines = proc.stdout.split("\n")
    assert "SURVIVED" not in lines
    return lines, [bytes.fromhex(ln.split()[1]) for ln in lines if ln.startswith("ACK ")]


@pytest.fixture(params=["ram_file", "disk"])
def tier_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if request.param == "ram_file":
        with shm_dir() as d:
            yield "ram_file", d
    else:
        yield "disk", tmp_path / "kvc"


def _expected(i: int) -> tuple[bytes, bytes, tuple[int, ...]]:
    key, req = row(i)
    return key, req.payload, req.tokens


@pytest.mark.parametrize("step", STEPS)
def test_kill9_at_every_publish_step(tier_root: tuple[str, Path], step: str) -> None:
    name, root = tier_root
    lines, acked = killed("kill", str(root), name, step, str(N_ACKED))
    victim_key, victim_payload, victim_tokens = _expected(N_ACKED)
    assert f"VICTIM {victim_key.hex()}" in lines
    assert len(acked) == N_ACKED

    leftovers = [n for n in os.listdir(root) if n.endswith(".tmp")]
    # The temp file exists from its creation until it is unlinked after the link.
    in_tmp_window = STEPS.index("tmp_opened") <= STEPS.index(step) < STEPS.index("tmp_unlinked")
    assert bool(leftovers) == in_tmp_window, leftovers

    tier = FileTier(name, root, 1 << 30)  # the restart
    rows = {r.info.key: r for r in tier.scan()}
    for i, key in enumerate(acked):
        exp_key, payload, tokens = _expected(i)
        assert key == exp_key and key in rows
        got = tier.load(rows[key])  # full CRC + key replay
        assert bytes(got.payload) == payload and got.tokens == tokens
    victim_visible = STEPS.index(step) >= VISIBLE_FROM
    assert (victim_key in rows) == victim_visible
    assert set(rows) == set(acked) | ({victim_key} if victim_visible else set())
    for r in rows.values():  # nothing half-written is visible
        tier.load(r)
    listing = data_names(root)
    assert not [n for n in listing if n.endswith(".tmp")], listing
    assert sorted(listing) == sorted(f"{k.hex()}.kvc" for k in rows)  # nothing quarantined

    # A new process (fresh index, knowing only the acked rows) saves the victim again: it
    # adopts a linked-but-unannounced file through EEXIST, or writes it from scratch.
    book, steps = FakeBook(), []
    for key in acked:
        assert book.adopt(rows[key])
    writer = FileTier(name, root, 1 << 30, on_step=steps.append)
    key, req = request(victim_tokens, payload=victim_payload)
    assert key == victim_key
    row = writer.store(key, req, book)
    assert row is not None and book.published[key] == row
    assert ("adopted" in steps) == victim_visible
    assert bytes(writer.load(row).payload) == victim_payload
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
