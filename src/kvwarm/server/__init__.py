"""The OpenAI-compatible HTTP server (``create_app``)."""

from kvwarm.server.app import create_app

__all__ = ["create_app"]
