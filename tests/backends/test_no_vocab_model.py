"""A model without a vocabulary (tokenizer ``none``, as audio decoders ship) is refused at load
(found by review): llama.cpp loads it, then GGML_ASSERTs in every tokenize and token_to_piece,
so the first prompt sent to one an engine had loaded (a models_dir file a request names)
aborted the process. The engine runs in a child process, so an abort fails one test instead
of the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.tinymodels import write_tiny_model

from kvwarm.backends.llama import LlamaBackend
from kvwarm.errors import ModelLoadError

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]

_ENGINE_LOAD = """
import sys
import kvwarm
from kvwarm.errors import ModelLoadError
with kvwarm.Engine() as engine:
    try:
        model = engine.load_model(sys.argv[1])
    except ModelLoadError as exc:
        print("refused:", exc)
        print("CASE-OK")
        raise SystemExit(0)
    model.complete("hello", max_tokens=1)  # what aborted: the prompt's tokenize
    raise SystemExit("loaded and served")
"""


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("novocab") / "novocab.gguf"
    return str(write_tiny_model(out, "mamba", tokenizer="none"))


def test_the_backend_refuses_it(path: str) -> None:
    with pytest.raises(ModelLoadError, match="no vocabulary"):
        LlamaBackend().load_model(path)


def test_an_engine_load_is_a_typed_error(path: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_LOAD, path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    detail = (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    )
    assert proc.returncode == 0, detail
    assert proc.stdout.rstrip().endswith("CASE-OK"), detail
