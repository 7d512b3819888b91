"""The engine: one worker thread per model, its slots, and the cache-aware request path.

Start at ``api`` (the public names), then ``model`` (the caller's side) and ``worker`` (the
thread's side, with its rooms: ``admission``/``planner``, ``tick``, ``sampling``, ``cacheport``,
``outcomes``). Invariant: only a model's worker thread touches its context. The map, with the
request path: ``docs/architecture.md``, "Engine".
"""
