"""The KV cache: pure Python, usable with no model (see ``api.CacheApi``)."""
