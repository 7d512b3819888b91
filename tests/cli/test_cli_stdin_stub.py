"""What ``kvwarm complete`` and ``kvwarm chat`` read from stdin: text that is not UTF-8, lines
that look like the chat's commands (stub backend, in process; found by the library and CLI
review)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from kvwarm.cli import main

STUB = ["--backend", "stub", "--model", "stub-a", "--cache-dir", "none", "--temperature", "0"]


def _strict_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """stdin as Python opens it under a locale such as en_US.UTF-8: decoded strictly."""
    stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", stdin)


def test_a_prompt_on_stdin_that_is_not_utf8_is_one_line_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Latin-1 byte was a ``UnicodeDecodeError`` traceback; it is refused as the same byte
    given on the command line is (``sys.argv`` carries it as a lone surrogate)."""
    _strict_stdin(monkeypatch, b"caf\xe9 au lait")
    assert main(["complete", *STUB, "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvwarm: error: prompt contains a lone UTF-16 surrogate"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ended the REPL with a traceback, its conversation lost; now that turn alone is
    refused, as a turn the model refuses is (``run_chat``), and the exit status says so."""
    _strict_stdin(monkeypatch, b"hello\ncaf\xe9\nwhat next?\n")
    assert main(["chat", *STUB, "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert re.findall(r"\[turn (\d):", err) == ["1", "2"], err
    refused = [line for line in err.splitlines() if line.startswith("kvwarm: error:")]
    assert len(refused) == 1 and "not sent" in refused[0], err


def test_a_chat_message_that_starts_like_a_command_is_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message such as "/systemd will not boot" was taken for "/system d will not boot":
    the system prompt replaced and the conversation reset, the message never sent. Only the
    word ``/system`` (alone, or before its text) is the command."""
    _strict_stdin(monkeypatch, b"hello\n/systemd will not boot\n/system   be terse \nhi\n")
    assert main(["chat", *STUB, "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert re.findall(r"\[turn (\d):", err) == ["1", "2", "3"], err
    assert err.count("(system prompt set; conversation reset)") == 1, err
    cached = [int(n) for n in re.findall(r"cached (\d+)/", err)]
    assert cached[1] > 0, err  # turn 2 extended turn 1's conversation: nothing was reset


def test_complete_and_chat_load_the_configured_model_model_id_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: given several models (a server's config file), ``complete`` and
    ``chat`` loaded the first without a word, the others ignored, and no flag chose one
    (``cache explain`` has ``--model-id``). Here model ``small``'s window is too short for
    the prompt, model ``big``'s is not."""
    config = tmp_path / "kvwarm.toml"
    config.write_text(
        'backend = "stub"\ncache_dir = "none"\n'
        '[[models]]\nid = "big"\npath = "stub-big"\nn_ctx = 1024\n'
        '[[models]]\nid = "small"\npath = "stub-small"\nn_ctx = 32\n'
    )
    argv = ["--config", str(config), "--max-tokens", "1", "--temperature", "0"]
    prompt = "a prompt longer than thirty-two tokens, one token a byte on the stub"
    assert main(["complete", *argv, prompt]) == 0
    assert main(["complete", *argv, "--model-id", "small", prompt]) == 1
    assert "this model's context holds 32" in capsys.readouterr().err
    assert main(["complete", *argv, "--model-id", "nope", prompt]) == 2
    assert "--model-id nope: no such configured model (models: big, small)" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt + "\n"))
    assert main(["chat", *argv, "--model-id", "small"]) == 1  # the turn refused, reported
    assert "not sent" in capsys.readouterr().err
