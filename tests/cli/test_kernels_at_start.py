"""A command decides its process's matrix kernels at its start, in its main thread before any
other thread (``cli/common.decide_kernels``, ``engine/speculating.untile_at_start``): llama.cpp's
tiled K-quant kernel is turned off (``GGML_CPU_TILED_MM=0``, which ggml reads once) where a
model the process may load will speculate with K-quant weights. ``kvwarm serve`` decides over
every model it may load; ``kvwarm cache explain`` over its server's, with the same function, so
the namespace it explains is the one the server saved under, whichever model it names.

Each case runs in child processes (ggml reads the switch once per process), on tiny
random-weight K-quant models (``tests/tinymodels.py``)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.childkit import run_child
from tests.cli.test_cli import _wait_healthy, clean_env
from tests.tinymodels import (
    FTYPE_Q6_K,
    K_QUANT_EMBD,
    K_QUANT_HEADS,
    k_quant_keys,
    quantize,
    write_reranker,
    write_tiny_model,
)

from kvwarm.backends.llama import model_file

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not model_file.tiled_kernel_on(), reason="no tiled kernel to turn off"),
]

#: ``kvwarm serve`` up to the point where it builds its app (and its threads): what the
#: process's switch is then, and how many threads run.
SERVE = """
import os, sys, threading
import kvwarm.server
from kvwarm.errors import KvwarmError

def create_app(settings, **_):
    print("ENV", os.environ.get("GGML_CPU_TILED_MM"))
    print("THREADS", threading.active_count())
    raise KvwarmError("stopped where the app would be built")

kvwarm.server.create_app = create_app
from kvwarm.cli import main
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("kernels")
    wide = {"n_embd": K_QUANT_EMBD, "n_head": K_QUANT_HEADS}
    made = {
        name: write_tiny_model(
            out / f"{name}.gguf",
            "llama",
            seed=seed,
            stdev=0.02,
            keys=k_quant_keys,
            ftype=FTYPE_Q6_K,
        )
        for name, seed in (("plain", 7), ("drafting", 8))
    }
    made["reranker"] = quantize(
        write_reranker(out / "reranker.gguf", "decoder", **wide), FTYPE_Q6_K
    )
    embedder = write_reranker(out / "embedder.gguf", "encoder", pooling=1, **wide)
    made["embedder"] = quantize(embedder, FTYPE_Q6_K)
    (out / "dir").mkdir()
    made["dir"] = out / "dir"
    shutil.copyfile(made["drafting"], made["dir"] / "lone.gguf")  # a symlink is not served
    return made


def _model(model_id: str, path: Path, *extra: str) -> str:
    return "\n".join(["[[models]]", f'id = "{model_id}"', f'path = "{path}"', *extra]) + "\n"


SPEC = 'spec_type = "ngram-simple"'


def _config(tmp_path: Path, files: dict[str, Path], case: str) -> Path:
    head = f'cache_dir = "{tmp_path / "cache"}"\nn_ctx = 512\nn_batch = 64\n'
    body = {
        # The second model speculates: decided over all of them, not by load order.
        "second speculates": _model("plain", files["plain"])
        + _model("drafting", files["drafting"], SPEC),
        # The second model speculates, but need not be exact: llama-server's kernels.
        "second speculates inexactly": _model("plain", files["plain"])
        + _model("drafting", files["drafting"], SPEC, "spec_exact = false"),
        # Only a models_dir file could speculate, loaded on a request's demand later.
        "models_dir": f'{SPEC}\nmodels_dir = "{files["dir"]}"\n',
        # Given a spec_type, but none of them generates but the one that does not speculate.
        "none generates": _model("reranker", files["reranker"], SPEC)
        + _model("embedder", files["embedder"], SPEC)
        + _model("plain", files["plain"]),
    }[case]
    path = tmp_path / "config.toml"
    path.write_text(head + body)
    return path


@pytest.mark.parametrize(
    ("case", "given", "env"),
    [
        ("second speculates", None, "0"),
        ("models_dir", None, "0"),
        ("none generates", None, "None"),
        ("second speculates inexactly", None, "None"),
        ("second speculates", "1", "1"),  # the user's choice is kept
    ],
)
def test_serve_decides_its_kernels_before_any_thread_starts(
    tmp_path: Path, files: dict[str, Path], case: str, given: str | None, env: str
) -> None:
    """Found by review: the switch was set through ``os.environ`` by the loader thread, while
    other threads ran (C's ``setenv`` beside a ``getenv`` is not safe), and only by a
    speculating model loaded first (a second one found the first's context made: too late).
    Now ``serve`` decides in its main thread, before it builds the app, over every model it
    may load; a reranker or an embedding model given a ``spec_type`` does not count, nor a
    model whose ``spec_exact`` is false (its rows need not be exact: the kernel stays on)."""
    environ = clean_env(tmp_path)
    environ.pop("GGML_CPU_TILED_MM", None)
    if given is not None:
        environ["GGML_CPU_TILED_MM"] = given
    config = _config(tmp_path, files, case)
    done, lines = run_child(SERVE, str(config), prefixes=("ENV", "THREADS"), env=environ)
    assert "stopped where the app would be built" in done.stderr, done.stderr[-3000:]
    said = dict(line.split(maxsplit=1) for line in lines)
    assert said == {"ENV": env, "THREADS": "1"}, done.stderr[-3000:]


# --- kvwarm cache explain: the server's namespace, for any of its models ---------------------


def _port() -> int:
    """A free port of this test's range."""
    for port in range(18200, 18300):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 18200-18299")


#: Long enough to be saved (the env's 16-token minimum; the ``test`` tokenizer makes a token
#: of 5 bytes).
PROMPT = "a prompt the server saves, long enough for its policy to keep it, and then some more"


@pytest.fixture
def served(tmp_path: Path, files: dict[str, Path]) -> Iterator[tuple[dict[str, str], Path]]:
    """``kvwarm serve`` of two models, the second speculating, each asked ``PROMPT`` once;
    stopped (its saves flushed) before the test reads the cache."""
    environ = clean_env(tmp_path)
    environ.pop("GGML_CPU_TILED_MM", None)
    environ.update(KVWARM_POLICY_MIN_TOKENS="16", KVWARM_POLICY_COLD_MIN_TOKENS="16")
    config = _config(tmp_path, files, "second speculates")
    port = _port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwarm", "serve", "--config", str(config), "--port", str(port)],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_healthy(proc, base, 120), "server did not become ready"
        listed = {m["id"]: m["meta"] for m in httpx.get(base + "/v1/models").json()["data"]}
        # The second model speculates exactly: the kernel was off before the first loaded.
        assert listed["drafting"]["speculative"]["exact"] == "at any length", listed
        for model in ("plain", "drafting"):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            response = httpx.post(base + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    yield environ, config


def _explain(environ: dict[str, str], *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "kvwarm", "cache", "explain", "--json", *args, PROMPT],
        env=environ, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_explain_finds_each_models_rows_where_its_server_saved_them(
    served: tuple[dict[str, str], Path], files: dict[str, Path]
) -> None:
    """Found by review: explain computed a model's kernels as though it were its server's
    first (the one whose load could turn the tiled kernel off), so a model loaded second got
    another cache key than the server's, and its rows read as another namespace's. Now the
    server decides over all its models at its start, and explain with the same function over
    the same configuration: each model's rows are in the namespace explain names. Given one
    model alone, explain cannot know what else the server loaded, and misses."""
    environ, config = served
    for model in ("plain", "drafting"):
        found = _explain(environ, "--config", str(config), "--model-id", model)
        assert found["rows_in_namespace"] == 1, (model, found)
        assert found["namespaces"] == 2, found
        assert found["reason"] != "other_namespace", (model, found)
    alone = [f"--cache-dir={config.parent / 'cache'}", "--n-ctx=512", "--n-batch=64"]
    found = _explain(environ, *alone, "--model", str(files["plain"]))
    assert found["rows_in_namespace"] == 0, found  # the server turned the kernel off for it


def test_complete_decides_for_its_model_before_its_engine_starts(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """``kvwarm complete`` (and ``chat``) loads one model into an engine whose cache threads
    run by the time it loads, where the load's own fallback would refuse; it decides at its
    start instead, so a speculating K-quant model speculates exactly there too."""
    environ = clean_env(tmp_path)
    environ.pop("GGML_CPU_TILED_MM", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvwarm", "complete", "-v", "--model", str(files["drafting"]),
         "--spec-type", "ngram-simple", "--n-ctx", "512", "--n-batch", "64",
         "--cache-dir", str(tmp_path / "cache"), "--max-tokens", "2", PROMPT],
        env=environ, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiled K-quant kernel turned off for this process" in done.stderr
    assert "left on" not in done.stderr and "speculative decoding is off" not in done.stderr
