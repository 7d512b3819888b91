"""Built-in chat templates and ``--chat-template``: names, files, errors, and the prefix
stability multi-turn caching relies on (turn N's tokens are a prefix of turn N+1's)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.backends.chat_template import BUILTIN_TEMPLATES, render_chat, resolve_template
from kvwarm.errors import ConfigError, InvalidRequestError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <start_of_turn> there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_each_builtin_renders_every_content_verbatim(name: str) -> None:
    text = render_chat(BUILTIN_TEMPLATES[name], CHAT, bos_token="<s>", eos_token="</s>")
    for message in CHAT:
        assert message["content"] in text
    assert resolve_template(name) == (name, BUILTIN_TEMPLATES[name])


def test_gemma_opens_the_first_user_turn_with_the_system_prompt() -> None:
    text = render_chat(BUILTIN_TEMPLATES["gemma"], CHAT, bos_token="<bos>", eos_token="<eos>")
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi <start_of_turn> there")
    assert "<start_of_turn>model\nHello.<end_of_turn>\n" in text
    assert text.endswith("<start_of_turn>model\n")


def test_a_file_is_named_by_its_digest_and_bad_values_are_config_errors(tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    name, source = resolve_template(str(good))
    assert name.startswith("file:") and len(name) == 17 and source == good.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="not a valid Jinja"):
        resolve_template(str(bad))
    with pytest.raises(ConfigError, match="neither a built-in"):
        resolve_template("no-such-template")


@pytest.mark.parametrize("name", ["chatml", "gemma"])
def test_a_chosen_template_keeps_each_turn_a_prefix_of_the_next(name: str) -> None:
    eng = make_engine()
    try:
        model = eng.load_model(config=replace(stub_config(), chat_template=name))
        assert model.info().chat_template_name == name
        previous: tuple[int, ...] = ()
        for k in range(2, len(CHAT) + 1):
            tokens, _ = model.chat_tokens(CHAT[:k], add_generation_prompt=False)
            assert tokens[: len(previous)] == previous
            previous = tokens
    finally:
        eng.close()


def test_tojson_is_hugging_faces() -> None:
    """Templates are written for Hugging Face's renderer (found by review): jinja2's own
    ``tojson`` sorted keys (a schema's properties out of the order the client wrote them),
    escaped HTML (``it's <b>`` as ``it\\u0027s \\u003cb\\u003e``) and returned Markup, so a
    string joined to it was escaped too (functionary's ``<function=`` as ``&lt;function=``)."""
    tools = [{"name": "f", "description": "it's <b> & ü", "parameters": {"z": 1, "a": 2}}]
    source = "{{ tools | tojson }}|{{ '<function=' + (tools[0].parameters | tojson) + '>' }}"
    rendered = render_chat(source, [], bos_token="", eos_token="", tools=tools)
    assert rendered == (
        '[{"name": "f", "description": "it\'s <b> & ü", "parameters": {"z": 1, "a": 2}}]'
        '|<function={"z": 1, "a": 2}>'
    )
    indented = render_chat(
        "{{ tools[0].parameters | tojson(indent=2, sort_keys=true) }}",
        [],
        bos_token="",
        eos_token="",
        tools=tools,
    )
    assert indented == '{\n  "a": 2,\n  "z": 1\n}'


def test_loop_controls_and_generation_blocks_render() -> None:
    """Hugging Face's environment has ``{% break %}``/``{% continue %}`` and renders
    ``{% generation %}`` blocks as their body; both were syntax errors here, so such a
    model's every chat was a 400."""
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }};{% endgeneration %}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert render_chat(source, messages, bos_token="", eos_token="") == "a;"


@pytest.mark.parametrize(
    "source",
    [
        "{{ 1 / 0 }}",
        "{{ 10.0 ** 1000 }}",
        "{{ range(10 ** 9) | list }}",  # the sandbox's MAX_RANGE: an OverflowError
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",  # too deep to compile
    ],
    ids=["zero-division", "float-overflow", "range", "recursion", "nesting"],
)
def test_every_template_failure_is_an_invalid_request(source: str, tmp_path: Path) -> None:
    """Found by review: a template's arithmetic error, the sandbox's refusal of a huge range
    and a recursion too deep escaped ``render_chat`` untyped (a 500), where every other
    failure was an ``InvalidRequestError`` (a 400); a ``--chat-template`` file too deep to
    compile was a ``RecursionError`` at start where others are ``ConfigError``."""
    with pytest.raises(InvalidRequestError, match="chat template"):
        render_chat(source, CHAT, bos_token="", eos_token="")
    if source.startswith("{{ ((("):
        deep = tmp_path / "deep.jinja"
        deep.write_text(source)
        with pytest.raises(ConfigError, match="not a valid Jinja"):
            resolve_template(str(deep))
