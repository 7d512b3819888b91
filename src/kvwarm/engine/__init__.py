"""The engine: one worker per model, slots, cache-aware request path (see ``api``)."""
