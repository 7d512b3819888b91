"""Alternating two source trees in one benchmark run: each round runs the script's measuring
half (``--child``) in a fresh process under this tree's ``src/`` and, with ``--compare``,
another's (a worktree of an older commit), so that both see the same machine at nearly the same
time. The child prints its figures as JSON on its last line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def add_arguments(ap: argparse.ArgumentParser, rounds: int) -> None:
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--compare", default=None, help="another tree's src/ to alternate with")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def alternate(
    script: str, child_args: list[str], rounds: int, compare: str | None
) -> dict[str, list[Any]]:
    """Per tree ("this", and "other" with ``compare``), each round's child figures."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    trees = {"this": os.path.abspath(here)}
    if compare:
        trees["other"] = os.path.abspath(compare)
    got: dict[str, list[Any]] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": src}
            cmd = [sys.executable, script, "--child", *child_args]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            got[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return got
