"""The Python examples of the README and docs/python.md run as written (found by the library
review: tests/test_docs.py checks links only, so an example could drift from the API). The
README's ten lines run on the embedded model, in a process of their own; its placeholders
become real: ``model.gguf`` the embedded model's file, ``system_prompt`` a prompt long enough
to be saved (``min_tokens``, 512 by default)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
