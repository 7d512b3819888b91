"""``engine.ops``: every model operation declared once; the registry is derived from the
protocols, and the in-process ``Model`` implements every declared operation."""

from __future__ import annotations

from kvwarm.engine.model import Model
from kvwarm.engine.ops import CALLS, OPS, STREAMS, ModelCalls, ModelOps, ModelStreams


def test_the_registry_is_derived_from_the_protocols() -> None:
    assert {"tokenize", "detokenize", "embed", "prewarm", "info", "infill_tokens"} <= CALLS
    assert {"stream", "submit", "stream_chat", "streams", "chat_streams"} == STREAMS
    assert not CALLS & STREAMS
    assert {name for name, kind in OPS.items() if kind == "call"} == CALLS
    assert {name for name, kind in OPS.items() if kind == "stream"} == STREAMS
    # A new method on a protocol is a new op, with nothing else to list.
    assert all(callable(getattr(ModelCalls, name)) for name in CALLS)
    assert all(callable(getattr(ModelStreams, name)) for name in STREAMS)


def test_the_engine_model_implements_every_declared_operation() -> None:
    for name in [*OPS, "status"]:
        implemented = getattr(Model, name)
        assert implemented is not getattr(ModelOps, name), name  # not the protocol's stub
        assert callable(implemented), name
