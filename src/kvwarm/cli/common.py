"""Shared CLI plumbing: settings from flags, logging, loading a model with a progress bar.

Invariant: progress bars and diagnostics go to stderr, results to stdout, so a command's output
can be piped; bars are shown only on a terminal (tqdm's ``disable=None``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from kvwarm.errors import ConfigError
from kvwarm.settings import (
    ModelSpec,
    Settings,
    add_settings_arguments,
    load_settings,
    model_config,
    settings_flags,
    user_cache_dir,
)
from kvwarm.settings.model import MODEL_SETTING_NAMES

if TYPE_CHECKING:
    from kvwarm.engine.api import Engine, Model

# Where the cache lives: what every command that opens the cache takes.
_TIER_SETTINGS: tuple[str, ...] = (
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
    "s3_min_bytes_per_s",
    "s3_packs",
    "tiers",
)
MODEL_SETTINGS: tuple[str, ...] = (
    "models",
    "backend",
    "n_ctx",
    "n_batch",
    *MODEL_SETTING_NAMES,
    "deterministic",
    "fingerprint_mode",
    *_TIER_SETTINGS,
    "save_tier",
    "store_prompt_text",
    "cache_eviction",
    "policy",
    "log_level",
)
CACHE_SETTINGS: tuple[str, ...] = (*_TIER_SETTINGS, "cache_eviction", "log_level")


def add_settings(parser: argparse.ArgumentParser, names: Sequence[str] = ()) -> None:
    add_settings_arguments(parser, names)
    if names:  # a one-shot command: quiet unless asked (serve, which takes all, logs INFO)
        parser.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=0,
            help="log INFO lines (-vv: DEBUG); default: warnings and errors only",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings of a command. Commands with ``--verbose`` log warnings only by default
    (their output is the result, not the log); ``log_level`` from any source still applies."""
    verbose = int(getattr(args, "verbose", -1))
    base = None if verbose < 0 else Settings(cache_dir=user_cache_dir(), log_level="warning")
    settings = load_settings(settings_flags(args), base=base)
    level = settings.log_level.upper()
    if verbose > 0:
        level = "INFO" if verbose == 1 else "DEBUG"
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return settings


@contextmanager
def stop_signals(handler: Callable[[int, FrameType | None], object]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler`` inside the block (a requested shutdown, not a death
    by signal); the previous handlers are back after it. Main thread only (``signal``'s rule)."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def decide_kernels(settings: Settings, specs: Sequence[ModelSpec] | None = None) -> bool:
    """A command's start, in its main thread before any other thread starts: llama.cpp's
    tiled K-quant kernel off for the process where a model it will load verifies drafts with
    weights that kernel multiplies (``engine/speculating.untile_at_start``; True if it turned
    it off). ``specs``: those models; by default every model ``kvwarm serve`` may load under
    ``settings``: the configured ones and the models_dir's files as they are now.
    ``kvwarm cache explain`` decides over its server's, so its cache keys are the server's."""
    from kvwarm import models_dir
    from kvwarm.engine.api import untile_at_start

    if specs is None:
        specs = list(settings.models)
        if settings.models_dir is not None:
            taken = {spec.model_id for spec in specs} | set(dict(settings.aliases))
            found = models_dir.scan(settings.models_dir)
            specs += [ModelSpec(str(p), mid) for mid, p in found.items() if mid not in taken]
    models = [(spec.path, model_config(settings, spec)) for spec in specs]
    return untile_at_start(models, backend=settings.backend)


def open_engine(settings: Settings) -> Engine:
    from kvwarm.engine.api import Engine, EngineConfig

    return Engine(EngineConfig(cache=settings.cache_config(), backend=settings.backend))


def add_model_id(parser: argparse.ArgumentParser, what: str) -> None:
    """``--model-id``: which of several configured models (a server's config file) a
    one-shot command uses."""
    parser.add_argument(
        "--model-id",
        metavar="ID",
        default=None,
        help=f"which configured model {what} (its id; default: the first, the server's default)",
    )


def chosen_model(specs: Sequence[ModelSpec], model_id: str | None) -> ModelSpec:
    """The configured model ``--model-id`` names (None: the first, the server's default)."""
    if model_id is None:
        return specs[0]
    for spec in specs:
        if spec.model_id == model_id:
            return spec
    known = ", ".join(spec.model_id for spec in specs)
    raise ConfigError(f"--model-id {model_id}: no such configured model (models: {known})")


@contextmanager
def loaded_model(settings: Settings, model_id: str | None = None) -> Iterator[Model]:
    """The configured model ``model_id`` names (None: the first), loaded with a progress bar;
    the engine is closed (and the cache flushed, so the next run finds this run's rows) on
    the way out."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    if not settings.models:
        raise ConfigError("no model to load: give --model (a models_dir is only for serve)")
    spec = chosen_model(settings.models, model_id)
    decide_kernels(settings, [spec])
    engine = open_engine(settings)
    try:
        # Log lines (llama.cpp's warnings included) print above the bar, never inside it.
        # disable=None: no bar at all when stderr is not a terminal.
        with (
            logging_redirect_tqdm(),
            tqdm(
                total=100,
                desc=f"loading {spec.model_id}",
                unit="%",
                file=sys.stderr,
                disable=None,
                leave=False,
            ) as bar,
        ):

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
