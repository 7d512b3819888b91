"""``GenerationOptions.preserved_tokens``: the special tokens whose text a reply keeps
(llama-server's ``preserved_tokens``). A control token's text is otherwise no part of the
reply; the server preserves tool-call markers so its parser sees them
(``tests/server/test_preserved_markers_model.py``). Here the engine's side, on a tiny model
whose ``[TOOL_CALLS]`` and ``[ARGS]`` are control tokens and whose greedy choice is fixed
(``tests.tinymodels.write_marker_model``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.tinymodels import write_marker_model

import kvwarm
from kvwarm.engine.model import Model
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError

TEMPLATE = "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
CALL = '[TOOL_CALLS]get_weather[ARGS]{"q": "x"}'
GRAMMAR = 'root ::= "Sure." "' + CALL.replace('"', '\\"') + '"'
MARKERS = ("[TOOL_CALLS]", "[ARGS]")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    path = tmp_path_factory.mktemp("preserved") / "mistral.gguf"
    write_marker_model(path, TEMPLATE, MARKERS)
    with kvwarm.Engine() as engine:
        yield engine.load_model(str(path), n_ctx=512, n_parallel=2)


@pytest.mark.model
def test_a_preserved_control_token_is_text_and_others_are_not(model: Model) -> None:
    kept = model.complete("hi", max_tokens=64, temperature=0, grammar=GRAMMAR,
                          preserved_tokens=MARKERS)  # fmt: skip
    assert kept.text == "Sure." + CALL
    # Free, the model writes [TOOL_CALLS] over and over: text only where it is preserved, and
    # a request that preserves nothing gets none (the worker's pieces are not the last one's).
    free = model.complete("hi", max_tokens=3, temperature=0, preserved_tokens=MARKERS)
    assert free.text == "[TOOL_CALLS]" * 3
    plain = model.complete("hi", max_tokens=3, temperature=0)
    assert plain.text == "" and plain.stats.completion_tokens == 3
    # Under the grammar, a marker not preserved is never its control token (the grammar
    # would match its text, which the reply leaves out: found by review, the reply was
    # 'Sure.get_weather{"q": "x"}'): it is spelled in bytes, and the reply is the grammar's.
    # EOS, which ends each, is never text.
    bare = model.complete("hi", max_tokens=64, temperature=0, grammar=GRAMMAR)
    assert bare.text == "Sure." + CALL
    one = model.complete("hi", max_tokens=64, temperature=0, grammar=GRAMMAR,
                         preserved_tokens=("[TOOL_CALLS]",))  # fmt: skip
    assert one.text == "Sure." + CALL
    tokens = [r.stats.completion_tokens for r in (kept, one, bare)]
    assert tokens == sorted(set(tokens)), tokens  # each marker spelled costs tokens
    assert one.stats.finish_reason == bare.stats.finish_reason == "stop"


@pytest.mark.model
def test_streamed_fragments_and_every_choice_keep_them(model: Model) -> None:
    stream = model.stream("hi", max_tokens=64, temperature=0, grammar=GRAMMAR,
                          preserved_tokens=MARKERS)  # fmt: skip
    assert "".join(stream) == "Sure." + CALL
    choices = model.streams("hi", n=2, max_tokens=64, temperature=0, grammar=GRAMMAR,
                            preserved_tokens=MARKERS, fragments=False)  # fmt: skip
    assert [c.result().text for c in choices] == ["Sure." + CALL] * 2


@pytest.mark.model
def test_a_text_that_is_no_single_token_is_plain_text(model: Model) -> None:
    """As llama-server's: a text of several tokens names no token to preserve; it is text in
    the reply anyway; EOS ends a reply, never text. A free reply of the model's favourite
    control token, not preserved, stays empty."""
    done = model.complete("hi", max_tokens=3, temperature=0,
                          preserved_tokens=("[TOOL_CALLS] ", "Sure", "</s>"))  # fmt: skip
    assert done.text == ""
    assert done.stats.completion_tokens == 3


@pytest.mark.parametrize(
    "value",
    [
        "[TOOL_CALLS]",  # one string, not a list of them
        ("",),
        (5,),
        ("x" * 257,),
        tuple(f"t{i}" for i in range(65)),
        ("\ud800",),
    ],
)
def test_bad_preserved_tokens_are_typed_errors(value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        GenerationOptions(preserved_tokens=value).validate()  # type: ignore[arg-type]
    assert caught.value.param == "preserved_tokens"
