"""Shared CLI plumbing: settings from flags, logging, loading a model with a progress bar.

Invariant: progress bars and diagnostics go to stderr, results to stdout, so a command's output
can be piped; bars are shown only on a terminal (tqdm's ``disable=None``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvwarm.settings import (
    Settings,
    add_settings_arguments,
    load_settings,
    model_config,
    settings_flags,
)
from kvwarm.settings_model import MODEL_SETTING_NAMES

if TYPE_CHECKING:
    from kvwarm.engine.api import Engine, Model

MODEL_SETTINGS: tuple[str, ...] = (
    "models",
    "backend",
    "n_ctx",
    "n_batch",
    *MODEL_SETTING_NAMES,
    "deterministic",
    "fingerprint_mode",
    "cache_dir",
    "disk_quota_bytes",
    "ram_quota_bytes",
    "shm_dir",
    "shm_quota_bytes",
    "cache_dir_shared",
    "s3_bucket",
    "s3_prefix",
    "s3_endpoint_url",
    "s3_region",
    "s3_quota_bytes",
    "s3_connect_timeout_s",
    "s3_read_timeout_s",
    "s3_max_attempts",
    "save_tier",
    "store_prompt_text",
    "cache_eviction",
    "policy",
    "log_level",
)
CACHE_SETTINGS: tuple[str, ...] = (
    "cache_dir",
    "disk_quota_bytes",
    "ram_quota_bytes",
    "shm_dir",
    "shm_quota_bytes",
    "cache_eviction",
    "cache_dir_shared",
    "s3_bucket",
    "s3_prefix",
    "s3_endpoint_url",
    "s3_region",
    "s3_quota_bytes",
    "s3_connect_timeout_s",
    "s3_read_timeout_s",
    "s3_max_attempts",
    "log_level",
)


def add_settings(parser: argparse.ArgumentParser, names: Sequence[str] = ()) -> None:
    add_settings_arguments(parser, names)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = load_settings(settings_flags(args))
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return settings


def open_engine(settings: Settings) -> Engine:
    from kvwarm.engine.api import Engine, EngineConfig

    return Engine(EngineConfig(cache=settings.cache_config(), backend=settings.backend))


@contextmanager
def loaded_model(settings: Settings) -> Iterator[Model]:
    """The first configured model, loaded with a progress bar; the engine is closed (and the
    cache flushed, so the next run finds this run's rows) on the way out."""
    from tqdm import tqdm

    spec = settings.models[0]
    engine = open_engine(settings)
    try:
        with tqdm(
            total=100,
            desc=f"loading {spec.model_id}",
            unit="%",
            file=sys.stderr,
            disable=None,
            leave=False,
        ) as bar:

            def progress(fraction: float) -> bool:
                bar.update(max(0, round(fraction * 100) - bar.n))
                return True

            model = engine.load_model(
                spec.path,
                model_id=spec.model_id,
                config=model_config(settings, spec),
                progress=progress,
            )
        yield model
    finally:
        engine.close()
