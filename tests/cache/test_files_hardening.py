"""The cache directory is not trusted: links are never followed, directories are private."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.cache.facadekit import NS, FakeClock, req
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import request

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.tiers import fsutil
from kvwarm.cache.tiers.files import FileTier
from kvwarm.errors import CacheDirMissingError, CacheFormatError, UnsafeCacheDirError


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _swap_for_link(tier: FileTier, key: bytes, target: Path) -> None:
    path = tier.path_for(key)
    os.unlink(path)
    os.symlink(target, path)


def test_a_row_swapped_for_a_symlink_is_never_followed(tmp_path: Path) -> None:
    root, target = tmp_path / "rows", tmp_path / "precious"
    target.write_bytes(b"x" * 4096)
    tier = FileTier("disk", root, 1 << 20)
    key, r = request((1, 2, 3))
    row = tier.store(key, r, FakeBook())
    assert row is not None
    _swap_for_link(tier, key, target)
    tier.record_hit(row, 7, 1234.0)  # used to write 12 bytes into the link's target
    with pytest.raises(CacheFormatError, match="symbolic link"):
        tier.load(row)
    assert tier.probe(key) is None
    assert list(tier.scan()) == []  # the link is quarantined, not its target
    tier.delete(key)
    assert target.read_bytes() == b"x" * 4096
    assert os.path.islink(root / "quarantine" / tier.path_for(key).name)


def test_facade_drops_a_linked_row_and_leaves_the_target(tmp_path: Path) -> None:
    root, target = tmp_path / "rows", tmp_path / "precious"
    target.write_bytes(b"y" * 100)
    with Cache(CacheConfig(tiers=(TierConfig("disk", 1 << 20, root),)), background=False) as c:
        assert c.save(req((4,) * 8, tier="disk"), sync=True)
        key = c.key_for(NS, (4,) * 8)
        info = c.lookup_exact(key)
        assert info is not None and info.tier == "disk"
        with c.open_row(key):
            pass  # a hit to persist
        _swap_for_link(FileTier("disk", root, 1 << 20), key, target)
        c.persist_hits()
        with pytest.raises(CacheFormatError), c.open_row(key):
            pass
        assert c.lookup_exact(key) is None and not os.path.lexists(root / f"{key.hex()}.kvc")
    assert target.read_bytes() == b"y" * 100


def test_a_fifo_in_place_of_a_row_cannot_hang_a_reader(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path / "rows", 1 << 20)
    key, _ = request((5, 6))
    os.mkfifo(tier.path_for(key))
    assert tier.probe(key) is None  # O_NONBLOCK: returns instead of waiting for a writer


def test_created_directories_are_0700_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    root = tmp_path / "a" / "b" / "rows"
    tier = FileTier("disk", root, 1 << 20, quarantine=True)
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [0o700] * 3
    (root / ("cd" * 32 + ".kvc")).write_bytes(b"garbage")
    assert list(tier.scan()) == []
    assert _mode(root / "quarantine") == 0o700


def test_our_own_0777_directory_is_tightened_to_0700(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    FileTier("disk", root, 1 << 20)
    assert _mode(root) == 0o700


def test_a_directory_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "theirs"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setattr(fsutil.os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(UnsafeCacheDirError, match="belongs to uid"):
        FileTier("disk", root, 1 << 20)
    assert _mode(root) == 0o777  # refused, not changed


def test_a_0777_cache_dir_around_the_root_loses_its_write_bits(tmp_path: Path) -> None:
    # The disk tier's root is <cache_dir>/rows: a world-writable cache_dir lets anyone rename
    # the root away and plant their own (issue 13: "a pre-existing 0777 directory").
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    FileTier("disk", cache_dir / "rows", 1 << 20)
    assert (_mode(cache_dir), _mode(cache_dir / "rows")) == (0o755, 0o700)


def test_a_read_only_open_creates_nothing(tmp_path: Path) -> None:
    """``repair=False`` (``kvwarm cache stats | ls | verify``) used to create the missing root
    and its parents: an inspection changed the disk."""
    root = tmp_path / "a" / "rows"
    with pytest.raises(CacheDirMissingError, match="does not exist") as caught:
        FileTier("disk", root, 1 << 20, repair=False)
    assert (caught.value.tier, caught.value.path) == ("disk", str(root))
    assert not (tmp_path / "a").exists()
    config = CacheConfig(tiers=(TierConfig("ram", 1 << 20), TierConfig("disk", 1 << 20, root)))
    with pytest.raises(CacheDirMissingError):
        Cache(config, repair=False, background=False)
    assert not (tmp_path / "a").exists()


def test_a_read_only_open_tightens_no_mode(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    (cache_dir / "rows").mkdir(parents=True)
    cache_dir.chmod(0o777)
    (cache_dir / "rows").chmod(0o755)
    tier = FileTier("disk", cache_dir / "rows", 1 << 20, repair=False)
    assert list(tier.scan()) == []
    tier.close()
    assert (_mode(cache_dir), _mode(cache_dir / "rows")) == (0o777, 0o755)


def test_a_sticky_parent_is_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)  # /tmp, /dev/shm: others cannot rename what is ours
    FileTier("ram_file", shared / "kvwarm", 1 << 20)
    assert _mode(shared) == 0o1777


def test_a_sticky_directory_given_as_the_root_itself_is_refused_untouched(tmp_path: Path) -> None:
    """``--shm-dir /dev/shm`` (not ``/dev/shm/kvwarm``): as root, the tier tightened
    /dev/shm itself to 0700 and locked every other user of it out (found by review)."""
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(UnsafeCacheDirError, match="shared directory"):
        FileTier("ram_file", shared, 1 << 20)
    assert _mode(shared) == 0o1777


def test_a_writable_parent_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "theirs"
    (parent / "rows").mkdir(parents=True)
    parent.chmod(0o777)
    owner = os.stat(parent).st_uid
    # The root (rows) is ours; the parent belongs to someone else who lets anyone write it.
    monkeypatch.setattr(fsutil.os, "fstat", _owned_by(owner + 1, parent, fsutil.os.fstat))
    monkeypatch.setattr(fsutil.os, "geteuid", lambda: owner + 1)
    with pytest.raises(UnsafeCacheDirError, match="lets other users replace"):
        FileTier("disk", parent / "rows", 1 << 20)
    assert _mode(parent) == 0o777


def _victim_dir(tmp_path: Path) -> Path:
    """A directory of ours elsewhere, with what a tier's scans would clean up or tighten."""
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    (victim / "draft.tmp").write_text("precious")
    (victim / ("ab" * 32 + ".kvc")).write_text("not a row")
    return victim


def _untouched(victim: Path) -> bool:
    names = sorted(os.listdir(victim))
    return _mode(victim) == 0o755 and names == ["ab" * 32 + ".kvc", "draft.tmp"]


def test_a_parent_of_another_user_is_refused_even_if_only_its_owner_may_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --cache-dir /tmp/kvwarm made beforehand by another user (0755, so not "writable by
    # others"), with rows -> a directory of ours: the scans used to chmod it 0700, delete its
    # *.tmp files and quarantine its *.kvc files.
    victim = _victim_dir(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o755)
    (theirs / "rows").symlink_to(victim)
    stranger = os.geteuid() + 1
    monkeypatch.setattr(fsutil.os, "fstat", _reported_owner(theirs, stranger, fsutil.os.fstat))
    with pytest.raises(UnsafeCacheDirError, match="belongs to uid"):
        tier = FileTier("disk", theirs / "rows", 1 << 20)
        list(tier.scan())
    assert _untouched(victim)


def test_a_root_linked_by_another_user_in_a_sticky_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --shm-dir /dev/shm/kvwarm planted beforehand by another user as a link to our directory.
    victim = _victim_dir(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    planted = shm / "kvwarm"
    planted.symlink_to(victim)
    stranger, lstat = os.geteuid() + 1, fsutil.os.lstat

    def reported(path: str | os.PathLike[str]) -> os.stat_result:
        st = lstat(path)
        if Path(path) != planted:
            return st
        fields = list(st)
        fields[stat.ST_UID] = stranger
        return os.stat_result(fields)

    monkeypatch.setattr(fsutil.os, "lstat", reported)
    with pytest.raises(UnsafeCacheDirError, match="symbolic link"):
        tier = FileTier("ram_file", planted, 1 << 20)
        list(tier.scan())
    assert _untouched(victim)


def test_our_own_link_as_the_root_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "big-disk" / "rows"
    target.mkdir(parents=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "rows").symlink_to(target)
    tier = FileTier("disk", tmp_path / "cache" / "rows", 1 << 20)
    key, r = request((1, 2, 3))
    assert tier.store(key, r, FakeBook()) is not None
    assert (target / f"{key.hex()}.kvc").is_file()


def _reported_owner(
    directory: Path, uid: int, fstat: Callable[[int], os.stat_result]
) -> Callable[..., object]:
    """``os.fstat`` that reports ``directory`` (only) as owned by ``uid``."""
    ino = os.stat(directory).st_ino

    def fake(fd: int) -> os.stat_result:
        st = fstat(fd)
        if st.st_ino != ino:
            return st
        fields = list(st)
        fields[stat.ST_UID] = uid
        return os.stat_result(fields)

    return fake


def _owned_by(
    uid: int, parent: Path, fstat: Callable[[int], os.stat_result]
) -> Callable[..., object]:
    """``os.fstat`` that reports every directory but ``parent`` as owned by ``uid``."""
    parent_ino = os.stat(parent).st_ino

    def fake(fd: int) -> os.stat_result:
        st = fstat(fd)
        if st.st_ino == parent_ino:
            return st
        fields = list(st)
        fields[stat.ST_UID] = uid
        return os.stat_result(fields)

    return fake


def test_rows_survive_a_long_downtime_and_expire_after_unused_uptime(tmp_path: Path) -> None:
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 20, tmp_path),), ttl_seconds=(300, 600, 900))
    with Cache(cfg, background=False) as c:
        assert c.save(req((1,) * 8, tier="disk"), sync=True)  # a SHORT row
    clock = FakeClock(float(os.stat(next(tmp_path.glob("*.kvc"))).st_mtime) + 10_000)
    with Cache(cfg, background=False, clock=clock) as c2:
        assert c2.gc().rows == 0 and len(c2.rows()) == 1  # 10000 s down: not "unused"
        clock.advance(299)
        assert c2.gc().rows == 0
        clock.advance(2)
        assert c2.gc().rows == 1 and not list(tmp_path.glob("*.kvc"))


# --- every ancestor, as ssh's StrictModes checks a key's path (issue 41) ----------------------

STRANGER = 65534  # nobody: a real other user, chown'd to (the tests run as root)


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")


def test_an_ancestor_of_another_user_above_the_parent_is_refused(tmp_path: Path) -> None:
    # /tmp/x/theirs (another user's, 0755) / ours / cache / rows: the parent (cache) and the
    # directory above it are ours, but the stranger may rename "ours" away and put a tree of
    # their own, or a link to a directory of ours, in its place.
    _needs_root()
    theirs = tmp_path / "theirs"
    (theirs / "ours" / "cache").mkdir(parents=True)
    os.chown(theirs, STRANGER, STRANGER)
    theirs.chmod(0o755)
    with pytest.raises(UnsafeCacheDirError, match=f"{theirs}.*belongs to uid {STRANGER}"):
        FileTier("disk", theirs / "ours" / "cache" / "rows", 1 << 20)
    assert _mode(theirs / "ours" / "cache" / "rows") == 0o700  # made (0700), never opened


def test_a_symlinked_ancestor_of_another_user_is_refused(tmp_path: Path) -> None:
    # The path names a link the stranger owns: they may point it anywhere at any time.
    _needs_root()
    real = tmp_path / "real"
    (real / "cache").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.chown(link, STRANGER, STRANGER, follow_symlinks=False)
    with pytest.raises(UnsafeCacheDirError, match=f"{link} .*symbolic link of uid {STRANGER}"):
        FileTier("disk", link / "cache" / "rows", 1 << 20)


def test_an_ancestor_reached_through_our_link_is_checked_where_it_leads(tmp_path: Path) -> None:
    # Our own link is followed, and the directories it leads through are checked in turn.
    _needs_root()
    theirs = tmp_path / "theirs"
    (theirs / "cache").mkdir(parents=True)
    os.chown(theirs, STRANGER, STRANGER)
    (tmp_path / "ours").symlink_to(theirs)
    with pytest.raises(UnsafeCacheDirError, match=f"{theirs}.*belongs to uid {STRANGER}"):
        FileTier("disk", tmp_path / "ours" / "cache" / "rows", 1 << 20)


def test_our_link_as_the_root_into_a_directory_of_another_user_is_refused(
    tmp_path: Path,
) -> None:
    # Found by review: --cache-dir ~/cache with rows -> /srv/theirs/rows (ours, in a directory
    # a stranger owns). The stranger swaps their rows for a link to a directory of ours, which
    # the tier then tightened to 0700 and whose *.tmp and *.kvc its scans would clean.
    _needs_root()
    victim = _victim_dir(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "rows").symlink_to(victim)
    os.chown(theirs, STRANGER, STRANGER)
    theirs.chmod(0o755)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "rows").symlink_to(theirs / "rows")
    with pytest.raises(UnsafeCacheDirError, match=f"{theirs}.*belongs to uid {STRANGER}"):
        tier = FileTier("disk", tmp_path / "cache" / "rows", 1 << 20)
        list(tier.scan())
    assert _untouched(victim)
    # A world-writable directory on the way is refused as it would be above any root.
    open_dir = tmp_path / "open"
    (open_dir / "rows").mkdir(parents=True)
    open_dir.chmod(0o777)
    (tmp_path / "cache" / "open").symlink_to(open_dir / "rows")
    with pytest.raises(UnsafeCacheDirError, match="writable by every user"):
        FileTier("disk", tmp_path / "cache" / "open", 1 << 20)
    assert _mode(open_dir) == 0o777


def test_a_world_writable_ancestor_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    # Ours (root's), but anyone may rename what is in it: refused, not tightened (it is not
    # the cache's directory to change).
    open_dir = tmp_path / "open"
    (open_dir / "cache").mkdir(parents=True)
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeCacheDirError, match="writable by every user"):
        FileTier("disk", open_dir / "cache" / "rows", 1 << 20)
    assert _mode(open_dir) == 0o777


def test_a_group_writable_ancestor_of_another_group_is_refused(tmp_path: Path) -> None:
    _needs_root()
    shared = tmp_path / "team"
    (shared / "cache").mkdir(parents=True)
    os.chown(shared, 0, STRANGER)
    shared.chmod(0o775)
    with pytest.raises(UnsafeCacheDirError, match=f"writable by group {STRANGER}"):
        FileTier("disk", shared / "cache" / "rows", 1 << 20)


def test_a_sticky_ancestor_and_our_own_links_are_accepted(tmp_path: Path) -> None:
    # /tmp-like (1777) above, reached through a link of ours: others may add names there but
    # not rename ours, so the tree below is still ours alone.
    sticky = tmp_path / "tmp"
    (sticky / "me" / "cache").mkdir(parents=True)
    sticky.chmod(0o1777)
    (tmp_path / "alias").symlink_to("tmp/me")  # relative, resolved against its directory
    tier = FileTier("disk", tmp_path / "alias" / "cache" / "rows", 1 << 20)
    key, r = request((1, 2))
    assert tier.store(key, r, FakeBook()) is not None
    assert (sticky / "me" / "cache" / "rows" / f"{key.hex()}.kvc").is_file()


def test_our_private_group_may_write_an_ancestor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The "user private group" layout (a home 0775, its group ours alone) is no opening.
    _needs_root()
    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)
    os.chown(home, 0, STRANGER)
    home.chmod(0o775)
    monkeypatch.setattr(fsutil.os, "getegid", lambda: STRANGER)
    monkeypatch.setattr(fsutil.grp, "getgrgid", lambda gid: grp_entry("root", gid, ["root"]))
    FileTier("disk", home / "cache" / "rows", 1 << 20)
    monkeypatch.setattr(
        fsutil.grp, "getgrgid", lambda gid: grp_entry("root", gid, ["root", "guest"])
    )
    with pytest.raises(UnsafeCacheDirError, match="writable by group"):
        FileTier("disk", home / "cache" / "rows2", 1 << 20)


def grp_entry(name: str, gid: int, members: list[str]) -> object:
    import grp

    return grp.struct_group((name, "x", gid, members))


def test_a_quarantine_that_cannot_be_used_does_not_stop_the_scan(tmp_path: Path) -> None:
    """``set_aside`` promises to log, never raise: a ``quarantine/`` left sticky (refused as a
    shared directory) used to raise ``UnsafeCacheDirError`` out of the startup scan."""
    root = tmp_path / "rows"
    tier = FileTier("disk", root, 1 << 20)
    good, r = request((1, 2, 3))
    assert tier.store(good, r, FakeBook()) is not None
    bad, _ = request((9, 9))
    tier.path_for(bad).write_bytes(b"garbage")
    os.mkdir(root / "quarantine", 0o700)
    os.chmod(root / "quarantine", 0o1700)
    assert [row.info.key for row in tier.scan()] == [good]
    assert tier.path_for(bad).exists()  # left in place, reported
    assert [why for _, why in tier.problems()] != []
    assert _mode(root / "quarantine") == 0o1700  # a refused directory is never changed
    tier.close()
