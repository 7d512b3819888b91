"""A background thread's loop: one step every interval until stopped, its failures said once a
run. A step that stays broken (NVML after a driver reset, a sweep step over a directory gone
bad) logged a traceback every interval for as long as the process ran (found by review):
the first failure of a run is logged with its traceback, the others at DEBUG, and the end of
the run is said."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def run_every(
    stop: threading.Event,
    interval_s: float,
    step: Callable[[], object],
    what: str,
    log: logging.Logger,
) -> None:
    """Run ``step`` every ``interval_s`` until ``stop`` is set (``what``: its name in logs,
    e.g. "cache sweep"); a failure never ends the loop."""
    failing = False
    while not stop.wait(interval_s):
        try:
            step()
        except Exception:
            level = logging.DEBUG if failing else logging.ERROR
            log.log(level, "%s failed; retrying each interval", what, exc_info=True)
            failing = True
        else:
            if failing:
                log.warning("%ss succeed again", what)
            failing = False
