"""The store: index + tiers (CacheCore), chunk I/O, the bounded writer pool, quotas."""
