"""``RemoteModel`` forwards every non-streaming operation of ``engine.ops`` to a replica by
name, with plain arguments; an operation declared there and forgotten here fails this test
(and mypy: ``RemoteModel`` would stay abstract). No Ray: the handle is a recording callable."""

from __future__ import annotations

import pytest

from kvwarm.cluster.calls import Failed, Generate, ModelOp
from kvwarm.cluster.remote import RemoteModel, ResponseStream
from kvwarm.engine.ops import CALLS, OPS, ModelOps
from kvwarm.engine.prompts import ExtraFile
from kvwarm.engine.types import ModelInfo
from kvwarm.errors import FimNotSupportedError


class Recorder:
    def __init__(self, answer: object = None) -> None:
        self.ops: list[ModelOp] = []
        self.answer = answer

    def __call__(self, op: ModelOp) -> object:
        self.ops.append(op)
        return self.answer


def _no_stream(call: Generate) -> ResponseStream:
    raise AssertionError("no generation expected")


def _remote(answer: object = None) -> tuple[RemoteModel, Recorder]:
    info = ModelInfo("m", "stub", "stub", 512, 64, 2, 100, 512, 8, 0, "", "00", "fast", "ram", True)
    recorder = Recorder(answer)
    return RemoteModel(info, _no_stream, recorder), recorder


def test_every_declared_operation_is_a_remote_model_method() -> None:
    for name in [*OPS, "status", "id"]:
        assert getattr(RemoteModel, name) is not getattr(ModelOps, name), name


@pytest.mark.parametrize(
    ("call", "op", "args", "kwargs"),
    [
        (
            lambda m: m.tokenize("hi", add_special=False),
            "tokenize",
            ("hi",),
            {"add_special": False},
        ),
        (lambda m: m.detokenize((1, 2)), "detokenize", ([1, 2],), {}),
        (
            lambda m: m.embed(["a", (3, 4)], normalize=False),
            "embed",
            (["a", [3, 4]],),
            {"normalize": False},
        ),
        (
            lambda m: m.infill_tokens("p", "s", extra=(ExtraFile("x"),)),
            "infill_tokens",
            ("p", "s"),
            {"extra": [ExtraFile("x")]},
        ),
        (
            lambda m: m.rerank("q", ("a", "b"), top_n=1, cache_salt="t"),
            "rerank",
            ("q", ["a", "b"]),
            {"top_n": 1, "cache_salt": "t"},
        ),
    ],
)
def test_a_forwarded_call_names_its_operation_and_sends_plain_values(
    call: object, op: str, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    model, recorder = _remote(answer=[7])
    assert callable(call)
    assert call(model) == [7]
    (sent,) = recorder.ops
    assert (sent.model_id, sent.op, sent.args, dict(sent.kwargs)) == ("m", op, args, kwargs)
    assert sent.op in CALLS


def test_a_replica_error_is_raised_as_itself() -> None:
    model, _ = _remote(answer=Failed(FimNotSupportedError("no FIM tokens")))
    with pytest.raises(FimNotSupportedError):
        model.infill_tokens("a", "b")
