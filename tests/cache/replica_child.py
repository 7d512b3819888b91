"""A replica saving the same chunked rows as its siblings into one shared tier, at once.

replica_child.py TIER_JSON ROUNDS    save ``ROWS`` ROUNDS times over (a fresh Cache each
round, as a restarted replica), then print the failed saves and the cache's counters as JSON

TIER_JSON: {"s3": {bucket, prefix, endpoint}} or {"redis": URL}. Waits for a line on stdin
before saving, so siblings start together.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

from tests.cache.chunkkit import chunked_request
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, S3Config, TierConfig

C = 16
# Conversations sharing a system prompt and each other's turns: chunks reused across rows.
ROWS = [tuple(range(40)) + tuple(range(100 * i, 100 * i + 8 * (i + 1))) for i in range(6)]


def tier_of(where: dict[str, object]) -> TierConfig:
    if "redis" in where:
        return TierConfig("shared", 1 << 30, url=str(where["redis"]))
    s3 = where["s3"]
    assert isinstance(s3, dict)
    config = S3Config(
        bucket=s3["bucket"], prefix=s3["prefix"], endpoint_url=s3["endpoint"], region="us-east-1"
    )
    return TierConfig("s3", 1 << 30, s3=config)


def main() -> None:
    tier = tier_of(json.loads(sys.argv[1]))
    rounds = int(sys.argv[2])
    sys.stdin.readline()
    failed = 0
    counters: dict[str, float] = {}
    for _ in range(rounds):
        with Cache(CacheConfig(tiers=(tier,), chunk_tokens=C), background=False) as cache:
            for tokens in ROWS:
                if cache.save(chunked_request(NS, tokens, tier=tier.name), sync=True) is None:
                    failed += 1
            for name, value in cache.counters().items():
                counters[name] = counters.get(name, 0) + value
    sys.stdout.write(json.dumps({"failed": failed, "counters": counters}) + "\n")


if __name__ == "__main__":
    main()
