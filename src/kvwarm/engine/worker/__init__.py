"""The worker's rooms: one thread per model owns its context and slots; admission, planning,
ticks, sampling, the cache port and outcomes run on it. Callers use ``Engine`` and ``Model``
instead."""
