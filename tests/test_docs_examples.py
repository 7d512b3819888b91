"""The Python examples of the README and docs/python.md run as written (found by the library
review: tests/test_docs.py checks links only, so an example could drift from the API). The
README's ten lines run on the embedded model, in a process of their own; its placeholders
become real: ``model.gguf`` the embedded model's file, ``system_prompt`` a prompt long enough
to be saved (``min_tokens``, 512 by default). docs/python.md's "The whole API" block runs
on the stub backend, and its options paragraph names every ``GenerationOptions`` field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def test_the_readme_and_python_md_start_with_the_same_five_lines() -> None:
    readme = python_blocks(ROOT / "README.md")
    python_md = python_blocks(ROOT / "docs" / "python.md")
    ten = next(b for b in readme if "kvwarm.load_model()" in b)
    assert python_md[0] in ten  # the five lines are the ten's start


@pytest.mark.model
@pytest.mark.slow
def test_the_readmes_ten_lines_run() -> None:
    from kvwarm.embedded import default_model_path

    ten = next(b for b in python_blocks(ROOT / "README.md") if "kvwarm.load_model()" in b)
    assert ten.count('"model.gguf"') == 1
    code = ten.replace('"model.gguf"', repr(str(default_model_path())) + ', model_id="big"')
    code = code.replace("n_ctx=4096", "n_ctx=512")  # a second model: keep its memory small
    code = 'system_prompt = "You are a terse assistant. " * 120\n' + code
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    stats = re.compile(r"(cold|partial|exact) \d+ [\d.]+$")  # print(out.stats.cache_hit, ...)
    assert any(stats.match(line) for line in done.stdout.splitlines()), done.stdout


def test_python_md_names_every_generation_option() -> None:
    """docs/python.md's "Options" paragraph names each field of ``GenerationOptions`` (found by
    the docs review: ``add_special`` and ``parse_special``, whose defaults differ from
    ``Model.tokenize``'s, were in no page), so a new option cannot go undocumented."""
    import dataclasses

    from kvwarm import GenerationOptions

    text = (ROOT / "docs" / "python.md").read_text()
    options = text[text.index("Options (`GenerationOptions`)") :]
    options = options[: options.index("\n\n")]
    named = set(re.findall(r"`(\w+)`", options))
    missing = [f.name for f in dataclasses.fields(GenerationOptions) if f.name not in named]
    assert not missing, missing


def test_python_mds_whole_api_runs_on_the_stub(tmp_path: Path) -> None:
    """docs/python.md's "The whole API" block runs as written on the stub backend (found by
    the docs review: nothing ran it, so a renamed method or keyword could linger there). Its
    placeholders become real: the model files stub ones (``fim`` for ``infill_tokens``, a
    reranker), the tier directories under ``tmp_path``, the adapters small files, the long
    system prompt one past ``min_tokens``, and ``docs``, ``texts`` and the reranker's adapter
    ``handle`` defined before their lines."""
    from kvwarm.errors import EngineClosedError

    blocks = python_blocks(ROOT / "docs" / "python.md")
    block = next(b for b in blocks if "Engine(EngineConfig" in b)
    swaps = {
        'Path("/dev/shm/kvwarm")': repr(str(tmp_path / "shm")),
        'Path.home() / ".cache/kvwarm/kv"': repr(str(tmp_path / "disk")),
        'engine.load_model("model.gguf", ': 'engine.load_model("stub-fim.gguf", backend="stub", ',
        'engine.load_model("reranker.gguf", ': (
            'engine.load_model("stub-reranker.gguf", backend="stub", '
        ),
        '"a long system prompt"': '"You are terse. " * 200',
        'ranker.rerank("q", docs, lora=': (
            'handle = ranker.load_adapter(LORA, scale=0.0).handle\nranker.rerank("q", docs, lora='
        ),
        '"lora.gguf"': "LORA",
        '"sql.gguf"': "SQL",
    }
    code = block
    for old, new in swaps.items():
        assert old in code, f"docs/python.md's example no longer has {old}"
        code = code.replace(old, new)
    ns: dict[str, Any] = {"docs": ["doc a", "doc b"], "texts": ["a", "b"]}
    for name in ("lora", "sql"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(f"a stub adapter: {name}".encode())
        ns[name.upper()] = str(path)
    exec("from kvwarm import Cancellation", ns)
    exec(compile(code, "docs/python.md", "exec"), ns)
    assert ns["info"].scale == 0.0  # the adapter loaded off
    with pytest.raises(EngineClosedError):  # as the page says of a closed engine's models
        ns["ranker"].rerank("q", ns["docs"])
