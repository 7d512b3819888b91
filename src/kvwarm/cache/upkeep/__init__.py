"""Upkeep: startup scans and sweeps, shared tiers (discovery, promotion, their GC),
memory pressure."""
