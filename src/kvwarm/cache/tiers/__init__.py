"""File tiers and the RAM tier."""
