"""py-spy around a benchmark's server: record its Python threads while a load runs, then print
the functions that held the most samples (py-spy needs ptrace rights over the process)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path


def py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record`` (250 Hz, raw stacks, per thread) attached to ``pid`` until ``stop``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy, "record", "-r", "250", "-f", "raw", "-o", str(out), "--threads"]
    return subprocess.Popen(
        [*cmd, "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def stop(spy: subprocess.Popen[bytes]) -> None:
    """End a recording; py-spy writes its file on SIGINT."""
    spy.send_signal(signal.SIGINT)
    spy.wait(60)


def top_frames(raw: Path, limit: int = 15, within: str = "") -> list[str]:
    """The functions that held the most samples (inclusive), from py-spy's raw output; with
    ``within``, only stacks through a function of that name (e.g. ``Worker._run``), counted
    as samples, not shares."""
    total = 0
    incl: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if within and not any(f.split(" (")[0] == within for f in frames):
            continue
        total += int(n)
        seen = set()
        for frame in frames:
            name = frame.split(" (")[0]
            where = frame.split("(")[-1].split(":")[0].rsplit("/", 1)[-1] if "(" in frame else ""
            key = f"{name} [{where}]"
            if key not in seen:
                seen.add(key)
                incl[key] += int(n)
    if within:
        return [f"{v:6d}  {k}" for k, v in incl.most_common(limit)]
    return [f"{100 * v / max(total, 1):5.1f}%  {k}" for k, v in incl.most_common(limit)]
