"""The order of a file tier's writes, syncs, links and unlinks, recorded by wrapping ``os``:
what a power loss (which, unlike kill -9, loses the page cache) may keep of a save or a
retire. The model is POSIX's, not one file system's: a file's bytes are durable once it is
fsync'ed or fdatasync'ed, a name (link, unlink, mkdir) once its directory is fsync'ed, and
anything not yet durable may reach the disk in any order.

- A name only ever appears for bytes already durable: every link of a temp file comes after
  its last write and its fdatasync.
- A manifest is linked only once every chunk it writes has its name durable (a directory
  fsync after the chunk's link), and a save returns only once its manifest's name is durable.
- A retire makes its manifests' unlinks durable before it unlinks a chunk they named: else a
  power loss could keep a manifest and lose its chunk.
- A cache root the tier creates has its name made durable (its parent fsync'ed): else a power
  loss could lose the whole directory, and every save acknowledged in it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.tiers.files import FileStore
from kvwarm.cache.tiers.layout import CHUNK_SUFFIX, ROW_SUFFIX
from kvwarm.errors import CacheIOError


@dataclass
class Journal:
    """Every recorded call, in order: (op, name) with names resolved to absolute paths."""

    events: list[tuple[str, str]] = field(default_factory=list)
    fds: dict[int, str] = field(default_factory=dict)

    def index(self, op: str, name: str, after: int = 0) -> int:
        for i in range(after, len(self.events)):
            if self.events[i] == (op, name):
                return i
        raise AssertionError(f"no {op} {name} after event {after}")

    def last(self, op: str, name: str, before: int) -> int:
        found = [i for i, e in enumerate(self.events[:before]) if e == (op, name)]
        return found[-1] if found else -1

    def mark(self, what: str) -> None:
        self.events.append(("mark", what))


def _path(name: Any, dir_fd: int | None, journal: Journal) -> str:
    name = os.fsdecode(name)
    if dir_fd is None or os.path.isabs(name):
        return os.path.abspath(name)
    return os.path.join(journal.fds[dir_fd], name)


@pytest.fixture
def journal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Journal]:
    j = Journal()
    real: dict[str, Callable[..., Any]] = {
        n: getattr(os, n)
        for n in ("open", "dup", "close", "fsync", "fdatasync", "link", "unlink", "mkdir", "writev")
    }

    def open_(name: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd: int = real["open"](name, flags, mode, dir_fd=dir_fd)
        j.fds[fd] = _path(name, dir_fd, j)
        return fd

    def dup(fd: int) -> int:  # a staged put's own descriptor of the tier's directory
        new: int = real["dup"](fd)
        if fd in j.fds:
            j.fds[new] = j.fds[fd]
        return new

    def close(fd: int) -> None:
        j.fds.pop(fd, None)
        real["close"](fd)

    def sync(op: str) -> Callable[[int], None]:
        def call(fd: int) -> None:
            real[op](fd)
            kind = "dirsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else op
            j.events.append((kind, j.fds.get(fd, f"fd {fd}")))

        return call

    def link(src: Any, dst: Any, *, src_dir_fd: int | None = None,
             dst_dir_fd: int | None = None, follow_symlinks: bool = True) -> None:  # fmt: skip
        real["link"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                     follow_symlinks=follow_symlinks)  # fmt: skip
        j.events.append(("link", _path(dst, dst_dir_fd, j)))
        j.events.append(("linked_from", _path(src, src_dir_fd, j)))

    def unlink(name: Any, *, dir_fd: int | None = None) -> None:
        real["unlink"](name, dir_fd=dir_fd)
        j.events.append(("unlink", _path(name, dir_fd, j)))

    def mkdir(name: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real["mkdir"](name, mode, dir_fd=dir_fd)
        j.events.append(("mkdir", _path(name, dir_fd, j)))

    def writev(fd: int, buffers: Any) -> int:
        n: int = real["writev"](fd, buffers)
        j.events.append(("write", j.fds.get(fd, f"fd {fd}")))
        return n

    for name, fake in (("open", open_), ("dup", dup), ("close", close), ("fsync", sync("fsync")),
                       ("fdatasync", sync("fdatasync")), ("link", link), ("unlink", unlink),
                       ("mkdir", mkdir), ("writev", writev)):  # fmt: skip
        monkeypatch.setattr(os, name, fake)
    yield j


def _cache(root: Path) -> Cache:
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256)
    return Cache(cfg, background=False)


def _durable_name(j: Journal, op_at: int, name: str, before: int) -> bool:
    """Whether the name change at event ``op_at`` is durable by event ``before``: its
    directory was fsync'ed in between."""
    parent = os.path.dirname(name)
    return any(e == ("dirsync", parent) for e in j.events[op_at + 1 : before])


def test_a_save_links_only_durable_bytes_and_returns_once_its_names_are(
    tmp_path: Path, journal: Journal
) -> None:
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        journal.mark("save")
        key = cache.save(chunked_request(NS, list(range(700)), tier="disk"), sync=True)
        assert key is not None
        journal.mark("saved")
    ev = journal.events
    start, end = ev.index(("mark", "save")), ev.index(("mark", "saved"))
    links = [(i, n) for i, (op, n) in enumerate(ev[start:end], start) if op == "link"]
    chunks = [(i, n) for i, n in links if n.endswith(CHUNK_SUFFIX)]
    rows = [(i, n) for i, n in links if n.endswith(ROW_SUFFIX)]
    assert len(chunks) == 3 and len(rows) == 1  # 700 tokens: chunks of 256, 256, 188
    for i, _ in links:  # the temp file behind each link: written, then fdatasync'ed, then linked
        tmp = ev[i + 1][1]
        wrote = journal.last("write", tmp, i)
        assert wrote > start
        assert journal.last("fdatasync", tmp, i) > wrote, f"{tmp} linked before its fdatasync"
    manifest_at = rows[0][0]
    for i, name in chunks:
        assert _durable_name(journal, i, name, manifest_at), f"{name} not durable before its row"
    assert _durable_name(journal, manifest_at, rows[0][1], end), "save returned before the dirsync"


def test_a_retire_makes_its_manifests_unlinks_durable_before_unlinking_their_chunks(
    tmp_path: Path, journal: Journal
) -> None:
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        key = cache.save(chunked_request(NS, list(range(700)), tier="disk"), sync=True)
        assert key is not None
        journal.mark("delete")
        assert cache.delete(key)
        journal.mark("deleted")
    ev = journal.events
    start, end = ev.index(("mark", "delete")), ev.index(("mark", "deleted"))
    unlinks = [(i, n) for i, (op, n) in enumerate(ev[start:end], start) if op == "unlink"]
    rows = [i for i, n in unlinks if n.endswith(ROW_SUFFIX)]
    chunks = [i for i, n in unlinks if n.endswith(CHUNK_SUFFIX)]
    assert len(rows) == 1 and len(chunks) == 3
    assert rows[0] < min(chunks)
    assert _durable_name(journal, rows[0], unlinks[0][1], min(chunks)), (
        "a chunk was unlinked while its manifest's unlink could still be lost"
    )


def test_a_created_cache_root_has_its_name_made_durable(tmp_path: Path, journal: Journal) -> None:
    root = tmp_path / "a" / "kvc"  # two directories to create
    with _cache(root) as cache:
        journal.mark("save")
        assert cache.save(chunked_request(NS, list(range(300)), tier="disk"), sync=True)
    ev = journal.events
    saved = ev.index(("mark", "save"))
    for made in (root.parent, root):
        at = ev.index(("mkdir", str(made)))
        assert _durable_name(journal, at, str(made), saved), f"{made}'s name never made durable"


def test_a_sweep_of_a_shared_directory_syncs_before_it_deletes_chunks(
    tmp_path: Path, journal: Journal
) -> None:
    root = tmp_path / "kvc"
    cfg = CacheConfig(
        tiers=(TierConfig("disk", 1 << 30, root=root, shared=True),), chunk_tokens=256
    )
    with Cache(cfg, background=False) as cache:
        key = cache.save(chunked_request(NS, list(range(700)), tier="disk"), sync=True)
        assert key is not None
        journal.mark("delete")
        assert cache.delete(key)  # another host's row may name its chunks: only forgotten
        (swept,) = cache.gc_shared(0.0, now=time.time() + 60)
        assert swept.deleted == 3
    ev = journal.events
    start = ev.index(("mark", "delete"))
    unlinks = [(i, n) for i, (op, n) in enumerate(ev[start:], start) if op == "unlink"]
    row = next(i for i, n in unlinks if n.endswith(ROW_SUFFIX))
    first_chunk = min(i for i, n in unlinks if n.endswith(CHUNK_SUFFIX))
    assert row < first_chunk
    assert _durable_name(journal, row, str(root / "x"), first_chunk)


def test_a_retire_whose_sync_fails_still_deletes_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory that cannot be synced: logged, and the chunks go all the same (kept, they
    would be files the index no longer counts)."""
    root = tmp_path / "kvc"

    def refuse(self: FileStore) -> None:
        raise CacheIOError("disk: syncing failed: EIO", errno=errno.EIO)

    with _cache(root) as cache:
        key = cache.save(chunked_request(NS, list(range(700)), tier="disk"), sync=True)
        assert key is not None
        monkeypatch.setattr(FileStore, "sync_deletes", refuse)
        with caplog.at_level(logging.WARNING):
            assert cache.delete(key)
        assert "syncing deletes failed" in caplog.text
        assert not [n for n in os.listdir(root) if n.endswith((ROW_SUFFIX, CHUNK_SUFFIX))]
        assert cache.counters()["tier_disk_bytes"] == 0
