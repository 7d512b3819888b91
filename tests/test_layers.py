"""The house's import rules, read from the source: data flows down, nothing imports upward
(docs/architecture.md, "Layers" and "The cache")."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "kvwarm"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "kvwarm" or m.startswith("kvwarm.")}


def _module(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _under(prefix: str) -> list[Path]:
    return sorted((SRC / prefix.replace("kvwarm.", "").replace(".", "/")).rglob("*.py"))


# Inside the cache, each wing may import the ground and the wings below it, never above.
WING_RANK = {
    "kvwarm.cache.formats": 1,
    "kvwarm.cache.tiers": 1,
    "kvwarm.cache.eviction": 1,
    "kvwarm.cache.index": 2,
    "kvwarm.cache.store": 3,
    "kvwarm.cache.upkeep": 4,
    "kvwarm.cache.facade": 5,
}


def _rank(module: str) -> int | None:
    for wing, rank in WING_RANK.items():
        if module == wing or module.startswith(wing + "."):
            return rank
    return None


def test_the_cache_imports_nothing_of_the_engine_the_server_or_llama_cpp() -> None:
    above = ("kvwarm.engine", "kvwarm.server", "kvwarm.cluster", "kvwarm.cli", "kvwarm.backends")
    for path in _under("kvwarm.cache"):
        bad = {m for m in _imports(path) if m.startswith(above)}
        assert not bad, f"{_module(path)} imports {sorted(bad)}"
        assert "llama_cpp" not in path.read_text(), _module(path)


def test_no_cache_wing_imports_a_wing_above_it() -> None:
    checked = 0
    for path in _under("kvwarm.cache"):
        own = _rank(_module(path))
        if own is None:
            continue
        for imported in _imports(path):
            other = _rank(imported)
            if other is not None and _rank(_module(path)) != other:
                checked += 1
                assert other < own, f"{_module(path)} imports {imported}, a wing above it"
    assert checked > 20  # the rule has something to hold


def test_the_ground_modules_import_nothing_of_kvwarm() -> None:
    for name in ("tokens", "alignment", "memory", "plugins", "gguf_meta", "media"):
        path = SRC / f"{name}.py"
        assert all(m.startswith("kvwarm.errors") for m in _imports(path)), name
