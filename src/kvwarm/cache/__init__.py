"""The KV cache: pure Python, usable with no model (see ``api.CacheApi``).

``Cache`` is the facade; the value types it takes and returns are re-exported here.
"""

from kvwarm.cache.api import CacheApi, LoadedRow, VerifyReport
from kvwarm.cache.facade import Cache
from kvwarm.cache.types import (
    CacheConfig,
    EvictResult,
    FingerprintMode,
    Namespace,
    PolicyConfig,
    PrefixMatch,
    PressureConfig,
    RowInfo,
    S3Config,
    SaveReason,
    SaveRequest,
    TierConfig,
    TierName,
    TtlClass,
)

__all__ = [
    "Cache",
    "CacheApi",
    "CacheConfig",
    "EvictResult",
    "FingerprintMode",
    "LoadedRow",
    "Namespace",
    "PolicyConfig",
    "PrefixMatch",
    "PressureConfig",
    "RowInfo",
    "S3Config",
    "SaveReason",
    "SaveRequest",
    "TierConfig",
    "TierName",
    "TtlClass",
    "VerifyReport",
]
