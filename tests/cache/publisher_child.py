"""Another process publishing one row into a shared tier, through a ``Cache`` of its own.

publisher_child.py CONFIG_JSON N_TOKENS      save tokens 0..N-1 (stub payload), print its key

CONFIG_JSON: {"disk": ROOT} for a shared directory, or {"s3": {bucket, prefix, endpoint}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

from tests.cache.tierkit import request

from kvwarm.cache import Cache, CacheConfig, S3Config, TierConfig


def main() -> None:
    where = json.loads(sys.argv[1])
    n = int(sys.argv[2])
    if "disk" in where:
        tier = TierConfig("disk", 1 << 30, Path(where["disk"]), shared=True)
    else:
        s3 = where["s3"]
        tier = TierConfig(
            "s3",
            1 << 30,
            s3=S3Config(
                bucket=s3["bucket"],
                prefix=s3["prefix"],
                endpoint_url=s3["endpoint"],
                region="us-east-1",
            ),
        )
    key, req = request(tuple(range(n)), tier=tier.name)
    with Cache(CacheConfig(tiers=(tier,)), background=False) as cache:
        assert cache.save(req, sync=True) == key
    sys.stdout.write(key.hex() + "\n")


if __name__ == "__main__":
    main()
