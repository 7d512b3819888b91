"""``kvwarm cache verify`` beside a server writing the same directory (documented as safe):
what that server removes meanwhile, a row with its manifest or a chunk just listed, is no bad
file. Found by review: a read-only verify whose rows or chunk listing another process's
eviction overtook reported them as bad (``disk holds no <key>.kvc``, ``invalid chunk``) and
exited 1 on a sound cache. A manifest that is still there while a chunk it names is gone is
still reported. Two ``Cache`` objects on one root stand for the two processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.test_startup_damage import C, N, config, run
from tests.cache.tierkit import NS

from kvwarm.cache import Cache
from kvwarm.cache.formats import chunkfmt
from kvwarm.cache.tiers.files import FileStore


def filled(root: Path, starts: range) -> None:
    with Cache(config(root), background=False) as writer:
        for start in starts:
            assert writer.save(chunked_request(NS, run(start), tier="disk"), sync=True)


def test_a_row_another_process_evicts_during_a_verify_is_not_reported(tmp_path: Path) -> None:
    filled(tmp_path, range(3))
    with Cache(config(tmp_path), background=False, repair=False) as reader:
        assert len(reader.rows()) == 3
        with Cache(config(tmp_path), background=False) as server:
            assert server.evict_bytes(1, ["disk"]).rows == 1  # manifest and chunks deleted
        report = reader.verify()
    assert report.bad == ()
    assert report.checked == 2


def test_a_manifest_whose_chunk_is_gone_is_still_reported(tmp_path: Path) -> None:
    filled(tmp_path, range(1))
    with Cache(config(tmp_path), background=False, repair=False) as reader:
        keys = chunkfmt.chunk_keys(NS, run(0), (C, C, N - 2 * C))
        (tmp_path / f"{keys[1].hex()}.kvk").unlink()
        report = reader.verify()
    assert report.checked == 1
    assert len(report.bad) == 1 and keys[1].hex() in report.bad[0][1]


@pytest.mark.parametrize("repair", [False, True])
def test_a_chunk_deleted_after_the_scan_listed_it_is_not_an_invalid_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, repair: bool
) -> None:
    """The startup scan lists the directory, then reads each chunk's head: a chunk deleted in
    between was reported (read-only) or "set aside" (repairing, with a false warning) as an
    invalid chunk."""
    filled(tmp_path, range(2))
    keys = chunkfmt.chunk_keys(NS, run(1), (C, C, N - 2 * C))
    victim = tmp_path / f"{keys[2].hex()}.kvk"
    names = FileStore.names

    def listed_then_evicted(store: FileStore, prefix: str) -> list[str]:
        listed = names(store, prefix)
        victim.unlink(missing_ok=True)  # another process's eviction, just after the listing
        return listed

    monkeypatch.setattr(FileStore, "names", listed_then_evicted)
    caplog.set_level(logging.INFO)
    with Cache(config(tmp_path), background=False, repair=repair) as reader:
        monkeypatch.setattr(FileStore, "names", names)
        report = reader.verify()
    assert not any("invalid chunk" in why for _, why in report.bad)
    assert not [r for r in caplog.records if "invalid chunk" in r.getMessage()]
    assert report.quarantined_chunks == 0
    # The manifest naming it is another matter: still there, it is reported (read-only) or
    # set aside by the repairing scan.
    bad_rows = [where for where, _ in report.bad if where.endswith(".kvc")]
    assert len(bad_rows) == (0 if repair else 1)
    assert report.quarantined_rows == (1 if repair else 0)
