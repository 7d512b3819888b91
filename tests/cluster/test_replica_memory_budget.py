"""``memory_budget`` in ``kvwarm cluster``: each engine replica applies it as ``serve`` does
(the RAM tier gets what the models leave, or ``MemoryBudgetError``). docs/cluster.md promises
the same settings as ``serve``; the replicas used to build their engine and load their models
without it, so the setting did nothing in a cluster.
"""

from __future__ import annotations

from tests.server.conftest import stub_settings

from kvwarm.cluster.replica import EngineReplica
from kvwarm.errors import MemoryBudgetError

BUDGET = 256 << 20  # 256 MiB
RAM_QUOTA = 1 << 30  # 1 GiB: more than the whole budget


def test_replica_ram_tier_fits_the_memory_budget() -> None:
    settings = stub_settings(memory_budget=BUDGET, ram_quota_bytes=RAM_QUOTA)
    try:
        replica = EngineReplica(settings, replica_id="replica-1")
    except MemoryBudgetError:
        return  # refused by the budget: it took effect
    try:
        quota = replica.engine.cache.counters()["tier_ram_quota_bytes"]
        assert quota <= BUDGET, (
            f"the replica's RAM tier quota is {int(quota)} bytes, over memory_budget {BUDGET}"
        )
    finally:
        replica.engine.close()
