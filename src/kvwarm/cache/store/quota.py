"""A tier's effective quota: its configured quota, capped by the space its filesystem has.

Invariants: a tier that stands on a filesystem (``FilesystemSpace``: the file tiers) can never
hold more than the bytes it already holds plus the filesystem's free space (``os.statvfs``,
what an unprivileged writer may use); a configured quota above that is capped, said once in
the log per tier and reported in the counters (``tier_<name>_effective_quota_bytes``,
``tier_<name>_quota_capped_by_filesystem``), which ``/cache/stats`` shows per tier. A tier
whose filesystem cannot be asked keeps its configured quota. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol, runtime_checkable

from kvwarm.cache.protocols import Tier
from kvwarm.cache.types import TierName

__all__ = ["FilesystemSpace", "QuotaCaps"]

log = logging.getLogger(__name__)


@runtime_checkable
class FilesystemSpace(Protocol):
    """A tier whose bytes live on a local or mounted filesystem."""

    def filesystem_free_bytes(self) -> int:
        """Bytes this process may still write there (``OSError`` if it cannot tell)."""
        ...


class QuotaCaps:
    """Computes effective quotas; remembers which tiers were said to be capped (log once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[TierName] = set()

    def effective(self, tier: Tier, used_bytes: int) -> tuple[int, bool]:
        """(effective quota, whether the filesystem capped it) for ``tier`` holding
        ``used_bytes``."""
        quota = tier.quota_bytes
        if not isinstance(tier, FilesystemSpace):
            return quota, False
        try:
            room = used_bytes + tier.filesystem_free_bytes()
        except OSError as exc:
            log.debug("%s: cannot ask its filesystem for free space: %s", tier.name, exc)
            return quota, False
        if room >= quota:
            return quota, False
        with self._lock:
            first = tier.name not in self._said
            self._said.add(tier.name)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: quota %d bytes exceeds the room on its filesystem; effective quota %d bytes "
            "(what it holds plus the filesystem's free space)",
            tier.name,
            quota,
            room,
        )
        return room, True
