"""Schema-driven fuzzing: every operation in the app's own ``/openapi.json``, no 5xx.

The schema is the app's generated OpenAPI document (``create_app(...).openapi()``, the body of
``GET /openapi.json``; a fixture asserts the live server serves exactly it), so a route added
later is fuzzed without touching this file. Each operation is sent schemathesis's generated
cases against a live uvicorn server on 127.0.0.1, with these checks:

- ``not_a_server_error``: no 5xx, ever;
- ``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``:
  what the server answers is what ``/openapi.json`` declares (every error is the declared
  ``ErrorResponse``; streams and ``/metrics`` declare their media types).

Two variants: the stub backend (valid and invalid cases, the coverage phase's boundary values,
60 generated cases an operation) and the real embedded model (``model``: 15 valid cases an
operation, ``max_tokens_limit`` 8 and a 512-token context so no fuzzed request decodes or
prefills for long). Admin endpoints (``/cache/*``) act on a throwaway disk tier under a
pytest temporary directory.

Deterministic: hypothesis is derandomized with no example database and schemathesis generates
deterministically (fixed seed, no cache), so every CI run sends the same requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvwarm.server import create_app
from kvwarm.settings import ModelSpec, Settings

from .conftest import LOW_POLICY, LiveServer, stub_settings

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

#: The generated document; building the app loads nothing (models load in its lifespan).
OPENAPI: dict[str, Any] = create_app(stub_settings()).openapi()


def schema(*, coverage: bool, mode: str) -> schemathesis.schemas.BaseSchema:
    """The document under schemathesis, reproducibly. ``coverage``: also send its coverage
    phase (every field at its boundary values, valid and invalid: hundreds of cases for a
    chat completion, so only where each costs microseconds). ``mode``: ``positive`` (valid
    by the schema), ``negative`` (not) or ``all``."""
    config = SchemathesisConfig.from_dict(
        {
            "seed": 13,
            "cache": {"enabled": False},
            "generation": {"deterministic": True, "database": "none", "mode": mode},
            # Stateful links need 200 response schemas; each operation is fuzzed alone.
            "phases": {"stateful": {"enabled": False}, "coverage": {"enabled": coverage}},
        }
    )
    return schemathesis.openapi.from_dict(OPENAPI, config=config)


STUB_SCHEMA = schema(coverage=True, mode="all")
# Invalid bodies are refused before the engine, by code the stub run covers; the real model's
# budget goes to cases valid by the schema, the ones that can reach its tokenizer and sampler.
MODEL_SCHEMA = schema(coverage=False, mode="positive")


def bounded(max_examples: int) -> hypothesis.settings:
    """Hypothesis settings for one operation: ``max_examples`` generated cases, reproducible."""
    return hypothesis.settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,  # a live server's latency is not the property under test
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=True,
    )


def serve(settings: Settings) -> Iterator[LiveServer]:
    live = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=live.base_url) as http:
            served = http.get("/openapi.json")
        assert served.status_code == 200 and served.json() == OPENAPI, "fuzzing a stale schema"
        yield live
    finally:
        live.stop()


# --- the stub backend ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cache = tmp_path_factory.mktemp("fuzz-stub") / "cache"
    yield from serve(stub_settings(cache_dir=cache, save_tier="disk"))


@STUB_SCHEMA.parametrize()
@bounded(max_examples=60)
def test_stub_answers_every_operation_without_5xx(
    case: schemathesis.Case, stub_server: LiveServer
) -> None:
    case.call_and_validate(base_url=stub_server.base_url, checks=CHECKS, timeout=30)


# --- the real model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = Settings(
        models=(ModelSpec(),),
        cache_dir=tmp_path_factory.mktemp("fuzz-model") / "cache",
        save_tier="disk",
        n_ctx=512,
        n_batch=64,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        max_body_bytes=64 << 10,
        default_max_tokens=4,
        max_tokens_limit=8,
    )
    yield from serve(settings)


@pytest.mark.model
@pytest.mark.slow
@MODEL_SCHEMA.parametrize()
@bounded(max_examples=15)
def test_model_answers_every_operation_without_5xx(
    case: schemathesis.Case, model_server: LiveServer
) -> None:
    case.call_and_validate(base_url=model_server.base_url, checks=CHECKS, timeout=120)
