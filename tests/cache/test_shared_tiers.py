"""Shared tiers through the facade: a row another process publishes (in a shared directory or
in s3) is a prefix hit at once, with no rescan; lookups are bounded; hits are promoted."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, request
from tests.s3kit import CREDENTIALS, MotoServer, aws_env, object_names

from kvwarm.alignment import align_down
from kvwarm.cache import Cache, CacheConfig, PolicyConfig, TierConfig
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.types import S3Config
from kvwarm.engine.worker.savegates import cold_save_length, probe_lengths
from kvwarm.errors import CacheIOError, CacheNetworkError

CHILD = Path(__file__).with_name("publisher_child.py")
SRC = str(Path(__file__).resolve().parents[2] / "src")
# The server's policy: rows of >= 64 tokens, cold saves at multiples of 512.
POLICY = PolicyConfig(
    min_tokens=64,
    cold_min_tokens=512,
    continued_interval=512,
    boundary_trim_tokens=32,
    boundary_align_tokens=512,
)
N_BATCH = 512


def publish_from_another_process(where: dict[str, object], n_tokens: int) -> bytes:
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": SRC}
    out = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(where), str(n_tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return bytes.fromhex(out.stdout.strip())


def _prompt(n_saved: int, n_total: int) -> tuple[int, ...]:
    """A prompt extending the published row's tokens (0..n_saved-1)."""
    return tuple(range(n_saved)) + (7,) * (n_total - n_saved)


def _assert_found_at_once(mine: Cache, key: bytes, tokens: tuple[int, ...], shared: int) -> None:
    assert mine.longest_prefix(NS, tokens) is None  # the index alone has not seen it
    probes = probe_lengths(len(tokens), POLICY, N_BATCH)
    match = mine.longest_prefix(NS, tokens, probe_lengths=probes)
    assert match is not None and match.row.key == key and match.n_shared == shared
    counters = mine.counters()
    assert counters["hits_shared"] == 1
    assert counters["probe_rounds"] == 1  # the longest wave held the row: one round trip


def _assert_promoted(mine: Cache, key: bytes, n_tokens: int) -> None:
    with mine.open_row(key) as row:
        assert row.tokens == tuple(range(n_tokens))
    assert mine.flush()
    info = mine.lookup_exact(key)
    assert info is not None and info.tier == "ram"  # copied to the local tier
    assert mine.counters()["promotions"] == 1
    with mine.open_row(key) as row:  # and served from there, CRC and all
        assert row.tokens == tuple(range(n_tokens))


def test_shared_dir_row_of_another_process_is_a_prefix_hit_at_once(tmp_path: Path) -> None:
    root = tmp_path / "nfs"
    tiers = (TierConfig("ram", 1 << 30), TierConfig("disk", 1 << 30, root, shared=True))
    with Cache(CacheConfig(tiers=tiers), background=False) as mine:
        key = publish_from_another_process({"disk": str(root)}, 512)
        _assert_found_at_once(mine, key, _prompt(512, 700), 512)
        _assert_promoted(mine, key, 512)
        assert (root / f"{key.hex()}.kvc").is_file()  # the shared copy stays for the others


def test_s3_row_of_another_process_is_a_prefix_hit_at_once(moto_server: MotoServer) -> None:
    bucket = moto_server.new_bucket()
    config = moto_server.config(bucket)
    tiers = (TierConfig("ram", 1 << 30), TierConfig("s3", 1 << 30, s3=config))
    with Cache(CacheConfig(tiers=tiers), background=False) as mine:
        where = {"s3": {"bucket": bucket, "prefix": config.prefix, "endpoint": config.endpoint_url}}
        key = publish_from_another_process(where, 1024)
        _assert_found_at_once(mine, key, _prompt(1024, 1500), 1024)
        _assert_promoted(mine, key, 1024)
        s3 = S3Tier(config, 1 << 30)
        assert object_names(s3) == [s3.object_name(key)]


def test_a_lookup_is_bounded(moto_server: MotoServer) -> None:
    tiers = (
        TierConfig("ram", 1 << 30),
        TierConfig("s3", 1 << 30, s3=moto_server.config(moto_server.new_bucket())),
    )
    cfg = CacheConfig(tiers=tiers, probe_max=16, probe_parallel=8)
    with Cache(cfg, background=False) as mine:
        tokens = _prompt(0, 8192)
        lengths = probe_lengths(len(tokens), POLICY, N_BATCH)
        assert len(lengths) == 16  # 8192 itself is a cold boundary too: 512..8192
        assert mine.longest_prefix(NS, tokens, probe_lengths=lengths) is None
        counters = mine.counters()
        assert counters["probes"] == 16
        assert counters["probe_rounds"] == math.ceil(16 / 8)


def test_probes_skip_lengths_the_index_already_beats(tmp_path: Path) -> None:
    root = tmp_path / "nfs"
    tiers = (TierConfig("ram", 1 << 30), TierConfig("disk", 1 << 30, root, shared=True))
    with Cache(CacheConfig(tiers=tiers), background=False) as mine:
        key = publish_from_another_process({"disk": str(root)}, 1024)
        tokens = _prompt(1024, 1100)
        first = mine.longest_prefix(NS, tokens, probe_lengths=(1100, 1024, 512))
        assert first is not None and first.row.key == key
        probes = mine.counters()["probes"]
        again = mine.longest_prefix(NS, tokens, probe_lengths=(1100, 1024, 512))
        assert again is not None and again.row.key == key
        assert mine.counters()["probes"] == probes + 1  # only 1100 is longer than the hit


@given(
    prompt=st.integers(1, 40_000),
    later=st.integers(0, 40_000),
    align=st.sampled_from([64, 256, 512, 2048]),
    n_batch=st.sampled_from([32, 128, 512, 1024]),
    min_tokens=st.integers(0, 1024),
    trim=st.integers(0, 64),
)
def test_probed_lengths_include_every_cold_save_length(
    prompt: int, later: int, align: int, n_batch: int, min_tokens: int, trim: int
) -> None:
    """Any cold save (``engine/worker/cacheport.py``) is found by a later prompt it prefixes."""
    policy = PolicyConfig(
        min_tokens=min_tokens,
        cold_min_tokens=min_tokens,
        cold_max_tokens=30_000,
        boundary_trim_tokens=trim,
        boundary_align_tokens=align,
    )
    saved = align_down(cold_save_length(prompt, policy), n_batch)
    if saved < max(1, min_tokens):
        return  # the engine writes no cold row
    lookup = saved + later
    assert saved in probe_lengths(lookup, policy, n_batch)
    assert lookup in probe_lengths(lookup, policy, n_batch)  # an exact row of the prompt


def test_shared_dir_reaps_temp_files_by_age_not_by_pid(tmp_path: Path) -> None:
    """On a multi-host directory a pid names a process on some host: a temp file whose pid is
    dead *here* may belong to a live writer elsewhere, so only age lets the scan reap it."""
    child = subprocess.Popen(["true"])  # a pid that no longer runs on this host
    child.wait()
    key, _ = request((1, 2, 3))
    tmp = f"{key.hex()}.kvc.{child.pid}.1.1.tmp"
    for shared in (True, False):
        root = tmp_path / f"shared-{shared}"
        FileTier("disk", root, 1 << 20, shared_dir=shared).close()
        (root / tmp).write_bytes(b"a writer on another host is still writing this")
        tier = FileTier("disk", root, 1 << 20, shared_dir=shared)
        assert list(tier.scan()) == []
        assert (root / tmp).exists() == shared
        assert tier.capabilities.local != shared  # a shared directory's bytes are remote
        tier.close()
    stale = FileTier("disk", tmp_path / "shared-True", 1 << 20, shared_dir=True, stale_tmp_s=0.0)
    assert list(stale.scan()) == [] and not (tmp_path / "shared-True" / tmp).exists()
    stale.close()


def test_wrong_bucket_is_an_io_error_not_an_outage(moto_server: MotoServer) -> None:
    tier = S3Tier(moto_server.config("no-such-bucket-here"), 1 << 30)
    key, req = request((4, 5, 6), tier="s3")
    with pytest.raises(CacheIOError) as info:
        tier.store(key, req, FakeBook())
    assert not isinstance(info.value, CacheNetworkError)
    assert not tier.wire.is_down()  # a refusal is an answer: the store is up


def test_a_store_that_never_answers_costs_one_bounded_timeout() -> None:
    """A black hole (connections accepted, nothing sent back): the read timeout bounds the
    first probe, and the store is then skipped at once until ``down_for_s`` passes."""
    with socket.create_server(("127.0.0.1", 0)) as hole:
        port = hole.getsockname()[1]
        config = S3Config(
            bucket="b-hole",
            endpoint_url=f"http://127.0.0.1:{port}",
            region="us-east-1",
            connect_timeout_s=2.0,
            read_timeout_s=2.0,
            max_attempts=1,
            down_for_s=60.0,
        )
        with aws_env():
            tier = S3Tier(config, 1 << 30)
            key, _ = request((1,))
            t0 = time.monotonic()
            with pytest.raises(CacheNetworkError):
                tier.probe(key)
            first = time.monotonic() - t0
            t1 = time.monotonic()
            with pytest.raises(CacheNetworkError):
                tier.probe(key)
            second = time.monotonic() - t1
        assert first < 20.0  # one read timeout (2 s), not an unbounded wait
        assert second < 1.0  # down: answered at once, no timeout waited out
        tier.close()


def test_probe_lengths_include_where_earlier_turns_ended() -> None:
    lengths = probe_lengths(1500, POLICY, N_BATCH, turn_ends=(40, 700, 1300))
    # the prompt, each turn's end (EOS stop) and the token before it (max_tokens stop), the
    # cold-save lengths; nothing under min_tokens (64), longest first
    assert lengths == (1500, 1300, 1299, 1024, 700, 699, 512)
    assert probe_lengths(63, POLICY, N_BATCH, turn_ends=(10,)) == ()


def test_a_shared_dir_keeps_rows_it_cannot_read(tmp_path: Path) -> None:
    """A row file another host's kvwarm wrote in a format this one does not read (a newer
    KVC version) is a miss here, neither reported bad nor quarantined, in a shared directory
    or a private one: the newer kvwarm reads it (``CacheNewerFormatError``; a private
    directory quarantined it before, and a rollback lost the newer version's rows)."""
    for shared in (True, False):
        root = tmp_path / f"shared-{shared}"
        tiers = (TierConfig("ram", 1 << 20), TierConfig("disk", 1 << 20, root, shared=shared))
        key, req = request(tuple(range(64)), tier="disk")
        with Cache(CacheConfig(tiers=tiers), background=False) as writer:
            assert writer.save(req, sync=True) == key
        row = root / f"{key.hex()}.kvc"
        data = bytearray(row.read_bytes())
        data[3] = 0xFF  # the header's version byte: a KVC version from the future
        row.write_bytes(bytes(data))
        with Cache(CacheConfig(tiers=tiers), background=False) as reader:
            assert reader.lookup_exact(key) is None
            assert not reader.verify().bad
        assert row.is_file()
        assert not (root / "quarantine" / row.name).exists()
