"""``kvwarm bench`` (runs ``bench/cold_warm.py``) and ``kvwarm models`` (what can be loaded).

Invariant: ``models`` never loads weights; it reports files and the settings' model list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kvwarm.cli.common import add_settings, settings_from
from kvwarm.embedded import (
    EMBEDDED_MODEL_ID,
    INSTALL_HINT,
    MODEL_ENV,
    embedded_model_path,
    is_file,
    model_id_for,
)
from kvwarm.errors import ConfigError
from kvwarm.models_dir import scan
from kvwarm.settings.types import path_kind


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="run the cold/warm benchmark (bench/cold_warm.py)",
        description="Run bench/cold_warm.py from the source checkout with this Python; "
        "arguments after 'bench' (and --script PATH) are passed to it, options included: "
        "kvwarm bench --lengths 512 1024 --matrix-only (its own help: kvwarm bench -- --help).",
    )
    bench.add_argument("--script", type=Path, default=None, help="benchmark script to run")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    bench.set_defaults(run=run_bench)

    models = sub.add_parser(
        "models",
        help="list loadable models (the embedded default included)",
        description="List the embedded default model, $KVWARM_MODEL, the configured models, "
        "the models of --models-dir and any .gguf files in --scan directories. Loads nothing.",
    )
    models.add_argument(
        "--scan",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="also list .gguf files under DIR (repeatable)",
    )
    models.add_argument("--json", action="store_true", help="machine-readable output")
    add_settings(models, ("models", "models_dir", "log_level"))
    models.set_defaults(run=run_models)


def bench_script() -> Path:
    # src/kvwarm/cli/misc.py -> the repository root holds bench/.
    return Path(__file__).resolve().parents[3] / "bench" / "cold_warm.py"


def run_bench(args: argparse.Namespace) -> int:
    script: Path = args.script or bench_script()
    if not script.is_file():
        print(
            f"kvwarm: error: benchmark script not found: {script} "
            "(benchmarks run from a source checkout)",
            file=sys.stderr,
        )
        return 1
    extra = [a for a in args.args if a != "--"]
    return subprocess.call([sys.executable, str(script), *extra])


def run_models(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    found: list[dict[str, object]] = []

    def add(model_id: str, path: Path | None, source: str) -> None:
        exists = path is not None and is_file(path)
        found.append(
            {
                "id": model_id,
                "path": str(path) if path else None,
                "source": source,
                "available": exists,
                "size": path.stat().st_size if exists and path else None,
            }
        )

    add(EMBEDDED_MODEL_ID, embedded_model_path(), "embedded")
    override = os.environ.get(MODEL_ENV)
    if override:
        add(model_id_for(override), Path(os.path.expanduser(override)), f"${MODEL_ENV}")
    for spec in settings.models:
        if spec.path is not None:
            add(spec.model_id, Path(os.path.expanduser(spec.path)), "settings")
    if settings.models_dir is not None:
        for model_id, path in scan(settings.models_dir).items():
            add(model_id, path, "models_dir")
    for directory in args.scan:
        if path_kind(directory, "--scan") != "dir":  # a typo listed nothing, without a word
            raise ConfigError(f"--scan {directory}: not a directory")
        for path in sorted(Path(os.path.expanduser(directory)).glob("**/*.gguf")):
            add(model_id_for(path), path, f"scan {directory}")
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for item in found:
        size = item["size"]
        state = f"{int(size) / 2**20:.1f} MiB" if isinstance(size, int) else "not installed"
        print(f"{item['id']:<32} {state:>14}  {item['source']:<12} {item['path'] or '-'}")
    if embedded_model_path() is None:
        print(f"note: {INSTALL_HINT}", file=sys.stderr)
    return 0
