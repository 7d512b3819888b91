"""The OpenAI-compatible HTTP server (``create_app``)."""
