"""``RemoteModel`` forwards every non-streaming operation of ``engine.ops`` to a replica by
name, with plain arguments; an operation declared there and forgotten here fails this test
(and mypy: ``RemoteModel`` would stay abstract). No Ray: the handle is a recording callable."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
from ray.exceptions import ActorUnavailableError

from kvwarm.cluster.calls import Failed, Finished, Generate, ModelOp, Served
from kvwarm.cluster.chains import chat_chain, text_chain
from kvwarm.cluster.remote import RemoteModel, RemoteStream, ResponseStream
from kvwarm.engine.ops import CALLS, OPS, ModelOps
from kvwarm.engine.prompts import ExtraFile
from kvwarm.engine.types import Completion, CompletionStats, GenerationOptions, ModelInfo
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


class Scripted:
    """A replica's generation as the handle streams it, from a script of items."""

    def __init__(self, items: list[object]) -> None:
        self._items = iter(items)

    def __anext__(self) -> Awaitable[object]:
        async def step() -> object:
            for item in self._items:
                return item
            raise StopAsyncIteration

        return step()

    def cancel(self) -> None:
        pass


def _finished(key: bytes) -> Finished:
    stats = CompletionStats(
        prompt_tokens=8,
        cached_tokens=0,
        completion_tokens=2,
        prefill_ms=0.0,
        generation_ms=0.0,
        queue_ms=0.0,
        cache_hit="cold",
        finish_reason="stop",
        key=key,
    )
    return Finished(Completion("yo", (), (), stats))


def test_a_conversation_under_other_lora_adapters_is_another_chain() -> None:
    """Rows and live KV never cross adapter sets, so neither may the chain a request is
    routed by, nor the previous turn's row it names as ``parent_key``: the same messages
    under an adapter and under the plain model were one chain (found by review)."""
    sent: list[Generate] = []

    def stream(call: Generate) -> ResponseStream:
        sent.append(call)
        return Scripted([Served("r1"), _finished(bytes([len(sent)]) * 32)])

    info = ModelInfo("m", "stub", "stub", 512, 64, 2, 100, 512, 8, 0, "", "00", "fast", "ram", True)
    model = RemoteModel(info, stream, Recorder())
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    adapter = GenerationOptions(lora=((1, 1.0),))
    plain = GenerationOptions(lora=())  # a model with adapters, none on for this request
    asyncio.run(model.stream_chat(turn1, options=adapter).aresult())
    asyncio.run(model.stream_chat(turn2, options=plain).aresult())
    assert sent[1].chain[0] != sent[0].chain[0]
    assert sent[1].options.parent_key is None  # not the adapter's row
    asyncio.run(model.stream_chat(turn2, options=adapter).aresult())
    assert sent[2].chain[0] == sent[0].chain[0]
    assert sent[2].options.parent_key == bytes([1]) * 32
    # No adapter on (an empty set, or scale 0) is the plain model's chain, as its rows are.
    assert chat_chain("m", turn1, lora=()) == chat_chain("m", turn1)
    assert chat_chain("m", turn1, lora=((1, 0.0),)) == chat_chain("m", turn1)
    assert text_chain("m", "x" * 600, lora=((2, 0.5),)) != text_chain("m", "x" * 600)


class Unreachable(Scripted):
    """A replica Ray says is unavailable (it may still be running the call)."""

    def __init__(self) -> None:
        super().__init__([Served("r-lost")])
        self.cancelled = False
        self._served = False

    def __anext__(self) -> Awaitable[object]:
        if self._served:
            raise ActorUnavailableError("unreachable", None)
        self._served = True
        return super().__anext__()

    def cancel(self) -> None:
        self.cancelled = True


def test_a_call_sent_again_cancels_the_attempt_it_gave_up() -> None:
    """An unreachable replica may still be generating: sending the call elsewhere must not
    leave it running to ``max_tokens`` in a slot nobody reads (found by review)."""
    attempts: list[ResponseStream] = []

    def start(avoid: tuple[str, ...]) -> ResponseStream:
        response: ResponseStream = (
            Unreachable() if not attempts else Scripted([Served("r2"), _finished(b"k" * 32)])
        )
        attempts.append(response)
        return response

    stream = RemoteStream(start, lambda _replica: None)
    done = asyncio.run(stream.aresult())
    assert done.text == "yo" and stream.lost == ["r-lost"]
    first = attempts[0]
    assert isinstance(first, Unreachable) and first.cancelled


class Hung:
    """A replica that stopped answering (its process stopped, its node cut off): a read of
    its next item never returns, and a cancel is never acknowledged."""

    def __init__(self, served: bool = True) -> None:
        self.reading = asyncio.Event()  # a read is waiting on it
        self.cancelled = False
        self._items: list[object] = [Served("r-hung")] if served else []

    def __anext__(self) -> Awaitable[object]:
        async def step() -> object:
            if self._items:
                return self._items.pop(0)
            self.reading.set()
            await asyncio.get_running_loop().create_future()  # never set
            raise AssertionError("a hung replica answered")

        return step()

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("streamed", [False, True])
def test_a_cancel_ends_a_read_its_hung_replica_never_answers(streamed: bool) -> None:
    """The server's deadline (``request_timeout_s``), shutdown and a client's disconnect end
    a generation by cancelling its stream; the read waiting for the replica's next item must
    end then, not when Ray acknowledges the cancel, which a hung replica never does (found
    by review: the request hung on past its deadline until Ray's health checks killed the
    replica)."""

    async def run() -> tuple[Completion | list[str], Hung, list[int]]:
        hung, ended = Hung(), []
        stream = RemoteStream(
            lambda _avoid: hung, lambda _replica: None, on_end=lambda: ended.append(1)
        )

        async def read() -> Completion | list[str]:
            if streamed:
                return [text async for text in stream]
            return await stream.aresult()

        reading = asyncio.ensure_future(read())
        await hung.reading.wait()
        stream.cancel()
        return await asyncio.wait_for(reading, 30), hung, ended

    out, hung, ended = asyncio.run(run())
    if streamed:
        assert out == []
    else:
        assert isinstance(out, Completion) and out.stats.finish_reason == "cancelled"
    assert hung.cancelled and ended  # cancelled on the replica, its admission given back
