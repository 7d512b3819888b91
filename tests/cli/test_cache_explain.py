"""``kvwarm cache explain`` on the stub (issue 25): the planner's reasoning for a prompt against
a cache directory, with the model's vocabulary only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwarm.cli import main

# The default save gates (512 tokens): the stub makes one token per byte.
PROMPT = "word " * 120


def explain(capsys: pytest.CaptureFixture[str], cache: Path, *args: str) -> dict[str, object]:
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a"]
    rc = main([*argv, "--cache-dir", str(cache), "--json", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    result: dict[str, object] = json.loads(out)
    return result


@pytest.fixture
def cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A cache directory a stub run has written one prompt's rows into."""
    # Greedy: a sampled reply that began with the next probe's "x" made the finish row hold
    # that probe whole (about 1 run in 90).
    argv = ["complete", "--backend", "stub", "--model", "stub-a", "--max-tokens", "2"]
    argv += ["--temperature", "0"]
    assert main([*argv, "--cache-dir", str(tmp_path / "c"), PROMPT]) == 0
    capsys.readouterr()
    return tmp_path / "c"


def test_explain_names_what_a_prompt_would_reuse(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = len(PROMPT.encode()) + 1  # one token per byte, and BOS
    out = explain(capsys, cache, PROMPT + "and more")
    assert out["reason"] == "new_tokens"
    assert out["found_tokens"] == out["reused_tokens"] == n
    assert out["prompt_tokens"] == n + len(b"and more")
    out = explain(capsys, cache, "nothing alike")
    assert out["reason"] in ("no_prefix", "new_tokens") and out["found_tokens"] <= 1


def test_explain_looks_in_every_namespace_for_the_operator(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = explain(capsys, cache, "--salt", "alice", PROMPT + "and more")
    assert out["reason"] == "other_namespace"
    assert out["detail"] == "context or salt" and out["rows_in_namespace"] == 0
    assert out["reused_tokens"] == 0 and out["found_tokens"] == len(PROMPT.encode()) + 1


def test_explain_reads_a_request_body(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"prompt": PROMPT + "and more"}))
    assert explain(capsys, cache, "--body", str(body))["reason"] == "new_tokens"
    body.write_text(json.dumps({"messages": [{"role": "user", "content": PROMPT}]}))
    out = explain(capsys, cache, "--body", str(body))
    assert isinstance(out["prompt_tokens"], int) and out["prompt_tokens"] > len(PROMPT)
    body.write_text("[1, 2]")
    rc = main(["cache", "explain", "--backend", "stub", "--cache-dir", str(cache), "--body",
               str(body)])  # fmt: skip
    assert rc == 1
    assert "JSON object" in capsys.readouterr().err


def test_explain_prints_one_line_for_people(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a"]
    assert main([*argv, "--cache-dir", str(cache), PROMPT + "x"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n_rows = explain(capsys, cache, PROMPT + "x")["rows_in_namespace"]
    tokens = len(PROMPT.encode()) + 2  # one a byte, and BOS
    # The namespaces counted as such: "(1 in all)" after "N rows" read as one row in all.
    assert lines[0] == (
        f"prompt: {tokens} tokens; {n_rows} rows in its namespace (1 namespace in the cache)"
    )
    assert lines[1].startswith("new_tokens: the rest of the prompt was never cached (found ")


@pytest.fixture
def tenant_cache(tmp_path: Path) -> Path:
    """A cache directory a server with ``cache_salt_from_auth`` wrote a request of the key
    ``sk-alice`` into: its rows are in that tenant's namespace alone."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import wait_ready

    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    settings = Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a"),),
        cache_dir=tmp_path / "c",
        api_key="sk-alice",
        cache_salt_from_auth=True,
        allowed_hosts=("testserver",),
    )
    body = {"model": "stub-a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        headers = {"Authorization": "Bearer sk-alice"}
        response = client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.json()
    return tmp_path / "c"


def test_explain_names_an_api_key_tenants_namespace(
    tenant_cache: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tenant's namespace is ``key:<digest>``: ``--salt`` could not name it (found by
    review). The key comes from the environment or standard input, never from argv."""
    n = len(PROMPT.encode()) + 1
    plain = explain(capsys, tenant_cache, PROMPT + "and more")
    assert plain["rows_in_namespace"] == 0 and plain["reason"] == "other_namespace"
    monkeypatch.setenv("ALICE_KEY", "sk-alice")
    alice = explain(capsys, tenant_cache, "--tenant-key-env", "ALICE_KEY", PROMPT + "and more")
    assert alice["reason"] == "new_tokens" and alice["reused_tokens"] == n
    assert isinstance(alice["rows_in_namespace"], int) and alice["rows_in_namespace"] >= 1
    tenant = alice["tenant_id"]
    assert isinstance(tenant, str) and len(tenant) == 64 and "sk-alice" not in json.dumps(alice)
    by_id = explain(capsys, tenant_cache, "--tenant-id", tenant, PROMPT + "and more")
    assert by_id["reused_tokens"] == n
    # A salt partitions the tenant further: a namespace of its own, empty here.
    salted = explain(capsys, tenant_cache, "--tenant-id", tenant, "--salt", "s", PROMPT)
    assert salted["rows_in_namespace"] == 0
    anonymous = explain(capsys, tenant_cache, "--anonymous", "--salt", "s", PROMPT)
    assert anonymous["rows_in_namespace"] == 0


def test_explain_reads_a_tenant_key_from_stdin(
    tenant_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import sys

    class _Stdin:
        buffer = io.BytesIO(b"sk-alice\n")

    monkeypatch.setattr(sys, "stdin", _Stdin())
    out = explain(capsys, tenant_cache, "--tenant-key-stdin", PROMPT + "and more")
    assert out["reused_tokens"] == len(PROMPT.encode()) + 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--tenant-id", "abc"), "64 hex digits"),
        (("--tenant-key-env", "KVWARM_TEST_UNSET_KEY"), "no API key in environment"),
    ],
)
def test_bad_tenant_options_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needle: str
) -> None:
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a"]
    # Usage errors: exit 2, as the CLI's other bad options.
    assert main([*argv, "--cache-dir", str(tmp_path / "c"), *args, PROMPT]) == 2
    assert needle in capsys.readouterr().err


def test_explain_without_a_prompt_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a"]
    assert main([*argv, "--cache-dir", str(tmp_path / "c")]) == 2
    assert "give a prompt or --body" in capsys.readouterr().err


def test_a_body_file_counts_as_given_whatever_it_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a ``--body`` whose JSON object was empty counted as no body, so alone
    it was told "give a prompt or --body FILE" (it had), and beside a prompt it was taken
    (and ignored) though only one of them may be given."""
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a"]
    argv += ["--cache-dir", str(tmp_path / "c")]
    (tmp_path / "c").mkdir()
    body = tmp_path / "body.json"
    body.write_text("{}")
    assert main([*argv, "--body", str(body)]) == 1
    assert "the body needs 'messages' or a string 'prompt'" in capsys.readouterr().err
    assert main([*argv, "--body", str(body), PROMPT]) == 2
    assert "give a prompt or --body FILE (one of them)" in capsys.readouterr().err


def test_explain_takes_the_servers_models_dir_and_aliases(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: explain decides the matrix kernels over every model the server may
    load, its ``models_dir``'s files (less those an alias names) included, as ``serve`` does,
    yet ``--models-dir`` and ``--alias`` were refused as unknown options (exit status 2): the
    server's command line could not be given, as ``--model-id``'s help asks."""
    models = tmp_path / "models"
    models.mkdir()
    out = explain(
        capsys, cache, "--models-dir", str(models), "--alias", "a=stub-a", PROMPT + "and more"
    )
    assert out["reason"] == "new_tokens"


def test_explain_answers_what_a_request_then_does_when_a_prewarmed_prompt_is_asked_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a prompt prewarmed (its row holds its final logits) and then answered
    (a finish row past it, smaller, which the prefix lookup names) was explained as
    ``last_token`` (its last token decoded again), while a request for it reuses every token
    from the prewarm row (``none``): explain lacked the lookup's rule for an exact row."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import wait_ready

    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    settings = Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a"),),
        cache_dir=tmp_path / "c",
        keepalive_interval_s=0,
        allowed_hosts=("testserver",),
    )
    body = {"model": "stub-a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    def serve(*calls: tuple[str, dict[str, object]]) -> list[dict[str, object]]:
        out = []
        with TestClient(create_app(settings)) as client:  # closing it flushes every save
            wait_ready(client.get)
            for path, call in calls:
                response = client.post(path, json=call)
                assert response.status_code == 200, response.json()
                out.append(response.json())
        return out

    serve(("/cache/prewarm", {"prompt": PROMPT, "keep_alive": False}), ("/v1/completions", body))
    said = explain(capsys, tmp_path / "c", PROMPT)
    # A fresh server: no slot holds the prompt's KV, only the rows explain read.
    timings = serve(("/v1/completions", body))[0]["timings"]
    assert isinstance(timings, dict)
    did = timings["cache_reason"]
    n = len(PROMPT.encode()) + 1
    assert did == {"reason": "none", "found_tokens": n, "reused_tokens": n}
    assert {k: said[k] for k in did} == did


def test_explain_renders_a_chat_body_with_tools_as_the_server_does(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a body's ``tools`` reached the template raw, so a model whose
    template does not show tools (the stub's) was explained without them (this body's 1089
    prompt tokens counted as 679), where the server describes them in the system message and
    renders a call in the history as text (``server/chat.plan``). explain plans the chat as
    the server does: its prompt is the request's."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import wait_ready

    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "f", "description": "look it up"}}
    body = {
        "messages": [
            {"role": "system", "content": PROMPT},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": [tool],
    }
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    said = explain(capsys, cache, "--body", str(path))
    settings = Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a"),),
        cache_dir=cache,
        keepalive_interval_s=0,
        allowed_hosts=("testserver",),
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        reply = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert reply.status_code == 200, reply.json()
    assert said["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]
    # A tool_choice is the server's too: "none" shows no tools.
    path.write_text(json.dumps({**body, "tool_choice": "none"}))
    assert explain(capsys, cache, "--body", str(path))["prompt_tokens"] < said["prompt_tokens"]
    path.write_text(json.dumps({**body, "tools": [{"type": "function"}]}))
    argv = ["cache", "explain", "--backend", "stub", "--model", "stub-a", "--cache-dir"]
    assert main([*argv, str(cache), "--body", str(path)]) == 1
    assert "tools.0.function" in capsys.readouterr().err
