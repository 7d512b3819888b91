"""``store_prompt_text``: a row file holds the prompt's words only when configured; without
them everything that reads rows (restores, listings, verify) works the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES, stub_config

from kvwarm.cache.formats import kvc
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import GenerationOptions

PROMPT = "My account number is 4242-1717 and my question is about caching."
MARK = "4242-1717"


def engine_with_disk(root: Path, *, store: bool) -> Engine:
    tiers = (TierConfig("ram", 64 << 20), TierConfig("disk", 256 << 20, root))
    cache = CacheConfig(tiers=tiers, store_prompt_text=store)
    return Engine(EngineConfig(cache=cache, policy=LOW_GATES))


def fill(root: Path, *, store: bool) -> list[kvc.KvcFields]:
    eng = engine_with_disk(root, store=store)
    try:
        model = eng.load_model(config=replace(stub_config(), save_tier="disk"))
        model.complete(PROMPT, GenerationOptions(max_tokens=6, temperature=0.0))
        model.prewarm("A prewarmed system prompt about 4242-1717, long enough to be saved.")
    finally:
        eng.close()
    files = sorted(root.glob("*.kvc"))
    assert files
    for path in files:
        assert (MARK.encode() in path.read_bytes()) is store
    return [kvc.parse(path.read_bytes()).meta.fields for path in files]


def test_row_files_hold_no_prompt_text_by_default(tmp_path: Path) -> None:
    fields = fill(tmp_path / "rows", store=False)
    assert {f.prompt_text for f in fields} == {""}
    assert all(f.tokens for f in fields)  # the tokens, which find the row, are all there


def test_row_files_hold_the_prompt_text_when_configured(tmp_path: Path) -> None:
    fields = fill(tmp_path / "rows", store=True)
    assert all(MARK in f.prompt_text for f in fields)


@pytest.mark.parametrize("store", [False, True])
def test_rows_without_text_restore_list_and_verify(tmp_path: Path, store: bool) -> None:
    root = tmp_path / "rows"
    fill(root, store=store)
    eng = engine_with_disk(root, store=False)
    try:
        rows = eng.cache.rows()
        assert rows and all(r.tier == "disk" for r in rows)
        assert eng.cache.verify().bad == ()
        model = eng.load_model(config=replace(stub_config(), save_tier="disk"))
        again = model.complete(PROMPT, GenerationOptions(max_tokens=6, temperature=0.0))
        assert again.stats.cache_hit == "exact"
    finally:
        eng.close()


def test_cache_cli_lists_and_verifies_rows_without_text(tmp_path: Path) -> None:
    fill(tmp_path / "cache" / "rows", store=False)  # the layout Settings.cache_config uses
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_")}
    env.update(PYTHONPATH=src, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    base = [sys.executable, "-m", "kvwarm", "cache"]
    flags = ["--cache-dir", str(tmp_path / "cache")]
    ls = subprocess.run(
        [*base, "ls", "--json", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert ls.returncode == 0, ls.stderr
    assert len(json.loads(ls.stdout)) == len(list((tmp_path / "cache" / "rows").glob("*.kvc")))
    verify = subprocess.run(
        [*base, "verify", *flags], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
