"""The README and ``docs/`` pages: every relative link points to a file that exists, and every
``#anchor`` to a heading of that page (GitHub's slugs), so moving text between pages cannot
leave a dead link behind. What the pages name exists: each ``make`` target, each flag of a
``kvwarm`` command line (on that command), each ``--flag`` (kvwarm's, a bench script's or
another tool's on a short list), each ``KVWARM_*`` variable, each key of a TOML example, each
file named in backticks and each server route (with its method); and ``/metrics`` exports
exactly the metric names the pages list, so a renamed or new metric cannot go undocumented.
The examples run: the `openai`/`anthropic` client snippets and every `curl` of an `sh` block,
against a stub server, with the responses the pages show. The other way round, every flag of
every command is named somewhere."""

from __future__ import annotations

import argparse
import ast
import json
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_slugs_follow_github() -> None:
    assert slug("Crash-safe publish (file tiers)") == "crash-safe-publish-file-tiers"
    assert slug("`n > 1` and slot statuses") == "n--1-and-slot-statuses"
    assert slug("The server's request path") == "the-servers-request-path"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    dead = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, "\n".join(dead)


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    for command in ("make serve", "make test"):
        assert command in readme
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / "README.md")}
    for page in ("server", "configuration", "cache", "cluster", "operations", "architecture"):
        assert f"{page}.md" in linked, page


# ---- what the pages name exists ---------------------------------------------------------------

JSON_HEADERS = {"content-type": "application/json"}
INLINE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*(?![\w-])")
# Other tools' flags the pages name: sglang-router's, `ray start`'s, llama-server's, pip's.
FOREIGN_FLAGS = {
    "--worker-urls", "--policy", "--cache-threshold", "--balance-abs-threshold",
    "--balance-rel-threshold", "--node-ip-address", "--head", "--block", "--address", "--port",
    "--draft-p-min", "--poll", "--rerank", "--no-deps", "--no-cache-dir", "--force-reinstall",
    "--no-tensor-first-split",
}  # fmt: skip


def text_of(page: Path) -> str:
    return page.read_text()


def code_lines(page: Path) -> Iterator[str]:
    """Each line of the page's fenced blocks (continuations joined) and each inline code span."""
    text = text_of(page)
    for block in FENCE.findall(text):
        yield from block.replace("\\\n", " ").splitlines()[1:-1]
    yield from INLINE.findall(FENCE.sub("", text))


def parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every ``kvwarm`` (sub)command's parser, by its words: ("cache", "ls")."""
    from kvwarm.cli import build_parser

    out: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        out[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk((*words, name), sub)

    walk((), build_parser())
    return out


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_every_make_target_named_exists() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    missing = [
        f"{page.name}: make {name}"
        for page in PAGES
        for line in code_lines(page)
        for name in re.findall(r"(?:^|[;&|(]\s*)make ([a-z][\w-]*)", line)
        if name not in targets
    ]
    assert not missing, missing


def test_every_kvwarm_command_line_parses_its_flags() -> None:
    """``kvwarm serve --n-ctx 2048``: ``serve`` takes ``--n-ctx``. ``kvwarm bench``'s arguments
    are its script's, checked below."""
    known = parsers()
    wrong = []
    for page in PAGES:
        for line in code_lines(page):
            for match in re.finditer(r"(?:^|[;&|(]\s*|\$ )kvwarm ([^#|&;`]*)", line):
                words = match.group(1).split()
                path: tuple[str, ...] = ()
                while words and (*path, words[0]) in known:
                    path, words = (*path, words[0]), words[1:]
                if not path:
                    continue  # prose: "kvwarm caches ..."
                if path == ("bench",):
                    continue
                have = options(known[path])
                for word in words:
                    flag = word.split("=", 1)[0].strip("[]")
                    if re.fullmatch(r"--?[a-z][a-z0-9-]*", flag) and flag not in have:
                        wrong.append(f"{page.name}: kvwarm {' '.join(path)} has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_every_flag_named_exists() -> None:
    """A ``--flag`` anywhere in the pages is kvwarm's, a bench script's or on FOREIGN_FLAGS."""
    ours = set().union(*(options(p) for p in parsers().values()))
    bench = "\n".join(p.read_text() for p in (ROOT / "bench").glob("*.py"))
    unknown = sorted(
        {
            f"{page.name}: {flag}"
            for page in PAGES
            for line in code_lines(page)
            for flag in FLAG.findall(line)
            if flag not in ours and flag not in FOREIGN_FLAGS and f'"{flag}"' not in bench
        }
    )
    assert not unknown, unknown


def test_every_flag_of_every_command_is_documented() -> None:
    """The other way round: each option of each ``kvwarm`` command (``complete --temperature``,
    ``models --scan``, ``cache ls --limit``...) is named in the pages by one of its spellings
    (``-v`` for ``--verbose``), settings' flags by the table of every setting. Found by the docs
    review: ``complete``'s and ``chat``'s sampling flags, ``chat --system``, ``models --scan``
    and ``--json``, ``bench --script`` and ``--version`` were in no page."""
    text = "\n".join(text_of(page) for page in PAGES)
    missing = sorted(
        {
            " ".join(("kvwarm", *words, action.option_strings[-1]))
            for words, parser in parsers().items()
            for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
            if not any(re.search(re.escape(s) + r"(?![\w-])", text) for s in action.option_strings)
        }
    )
    assert not missing, missing


def test_every_kvwarm_variable_named_exists() -> None:
    """``KVWARM_X`` is a setting's variable (``kvwarm.settings.env_var``), ``KVWARM_CONFIG``, or
    one the code reads by that literal name (``KVWARM_MODEL``, the tests' and benches')."""
    from kvwarm.settings import CONFIG_ENV, Settings, env_var

    code = "\n".join(
        p.read_text()
        for folder in ("src", "bench", "tests")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "test_docs.py"
    )
    known = {env_var(name) for name in Settings.model_fields} | {CONFIG_ENV}
    unknown = sorted(
        {
            f"{page.name}: {name}"
            for page in PAGES
            for name in re.findall(r"\bKVWARM_[A-Z0-9_]+", text_of(page))
            if name not in known and f'"{name}"' not in code
        }
    )
    assert not unknown, unknown


def documented_metrics() -> set[str]:
    return {
        name.rstrip("_")
        for page in PAGES
        for name in re.findall(r"\bkvwarm_[a-z0-9_]+", text_of(page))
        if not name.startswith("kvwarm_bench")
    }


def test_metrics_exported_are_the_documented_ones(tmp_path: Path) -> None:
    """Scrape a stub server that saved and restored a row on disk (so the tier, memory-kind
    and restore series exist) and compare its metric names with the pages' both ways."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from kvwarm.cache.types import PolicyConfig
    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    settings = Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a", id="a"),),
        cache_dir=tmp_path / "cache",
        n_ctx=512,
        n_batch=16,
        policy=PolicyConfig(min_tokens=16, cold_min_tokens=16, boundary_align_tokens=16),
        keepalive_interval_s=0,
        allowed_hosts=("testserver",),
    )
    body = {"model": "a", "prompt": "a b c d e f g h " * 8, "max_tokens": 2}
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:  # readiness, bounded
            assert time.monotonic() < deadline, "the stub model did not load"
            time.sleep(0.02)
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        key = first.json()["timings"]["cache_key"]
        assert key, first.json()["timings"]
        assert client.get(f"/cache/rows/{key}", params={"wait_ms": 30000}).status_code == 200
        again = client.post("/v1/completions", json=body)
        assert again.json()["timings"]["cached_tokens"] > 0, again.json()["timings"]
        text = client.get("/metrics").text
    exported = {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    assert {"kvwarm_cache_memory_bytes", "kvwarm_cache_tier_restores_total"} <= exported
    documented = documented_metrics()
    assert not exported - documented, f"not in docs/: {sorted(exported - documented)}"
    assert not documented - exported, f"not exported: {sorted(documented - exported)}"


_CODE = re.compile(r"[a-z]+(?:_[a-z]+)+")


def _code_word(node: ast.expr | None) -> str | None:
    value = node.value if isinstance(node, ast.Constant) else None
    return value if isinstance(value, str) and _CODE.fullmatch(value) else None


def _code_words(node: ast.expr | None) -> list[str | None]:
    """A code, or both of a conditional's (``"a_b" if refused else "c_d"``)."""
    if isinstance(node, ast.IfExp):
        return [_code_word(node.body), _code_word(node.orelse)]
    return [_code_word(node)]


def _error_sources() -> Iterator[tuple[Path, ast.Module]]:
    """The parsed source of the server and the cluster's ingress, whose errors server.md lists."""
    for top in ("server", "cluster"):
        for path in sorted((ROOT / "src" / "kvwarm" / top).rglob("*.py")):
            yield path, ast.parse(path.read_text())


def sent_errors() -> set[tuple[int, str]]:
    """Each (status, code) the server and the cluster's ingress may answer, read from their
    source: ``ErrorKind(status, type, code)``, ``HTTPError(status, ..., code=...)``, a refusal
    tuple ``(status, ..., code)`` and a ``{status: code}`` table (Anthropic's error types, which
    no OpenAI-shaped body carries as its code, left out)."""
    from kvwarm.server.errors import _ANTHROPIC_TYPES

    def status(node: ast.expr) -> int | None:
        value = node.value if isinstance(node, ast.Constant) else None
        return value if isinstance(value, int) and 400 <= value < 600 else None

    found: set[tuple[int, str]] = set()
    for _, tree in _error_sources():
        for node in ast.walk(tree):
            pair: list[tuple[int | None, str | None]] = []
            if isinstance(node, ast.Call) and node.args:
                given = next((k.value for k in node.keywords if k.arg == "code"), None)
                pair += [(status(node.args[0]), name) for name in _code_words(given)]
                if isinstance(node.func, ast.Name) and node.func.id == "ErrorKind":
                    pair.append((status(node.args[0]), _code_word(node.args[-1])))
            elif isinstance(node, ast.Tuple) and len(node.elts) >= 3:
                pair.append((status(node.elts[0]), _code_word(node.elts[-1])))
            elif isinstance(node, ast.Dict):
                pair += [
                    (status(k), _code_word(v))
                    for k, v in zip(node.keys, node.values, strict=True)
                    if k
                ]
            found |= {(s, c) for s, c in pair if s is not None and c is not None}
    return found - {item for item in _ANTHROPIC_TYPES.items() if item[1].endswith("_error")}


def test_every_error_code_is_documented() -> None:
    """server.md's table of errors holds exactly the (status, code) pairs the server sends,
    and every "503 `code`" a page names is one of them. Found by the docs review: 20 codes
    (`json_too_deep`, `key_required`, `not_supported_in_cluster`, `row_not_found`...) were in
    no page, so a client could not tell what they meant."""
    sent = sent_errors()
    assert {(404, "model_not_found"), (421, "host_not_allowed"), (408, "body_timeout")} <= sent
    text = text_of(ROOT / "docs" / "server.md")
    table = text[text.index("## Errors") :]
    table = table[: table.index("\n## ")]
    listed = {
        (int(status), name)
        for status, codes in re.findall(r"^\| (\d{3}) \| ([^|]+) \|", table, re.M)
        for name in re.findall(r"`(\w+)`", codes)
    }
    assert not sent - listed, f"not in server.md's errors: {sorted(sent - listed)}"
    assert not listed - sent, f"never sent: {sorted(listed - sent)}"
    named = {
        (int(status), name)
        for page in PAGES
        for status, name in re.findall(
            r"\b([45]\d\d)\)? `([a-z]+(?:_[a-z]+)+)`", text_of(page).replace("\n", " ")
        )
    }
    assert not named - sent, f"no such status for the code: {sorted(named - sent)}"


#: Raise sites whose code is no literal, with why each is whole: Starlette's own errors, coded by
#: the ``{404: ..., 405: ...}`` table beside them (which ``sent_errors`` reads): no route takes a
#: form or a body parameter, the only ways Starlette raises another status.
COMPUTED_CODES = {("server/app.py", "handle")}


def test_every_error_raised_carries_a_code() -> None:
    """Every ``HTTPError`` the server and the cluster's ingress raise, and every ``ErrorKind``
    an exception maps to, names its code as a literal (or a conditional of two): a client tells
    errors apart by their code, and ``sent_errors`` (hence server.md's table) sees each one.
    Found by review: 53 raise sites (``top_logprobs`` without ``logprobs``, ``background``
    without ``store``, a bad ``order``...) answered ``"code": null``, and the Responses API's
    404s named their codes through a variable, so the table above lacked them."""
    missing: list[str] = []
    for path, tree in _error_sources():
        where = path.relative_to(ROOT / "src" / "kvwarm").as_posix()
        # The function each node is in, the innermost (``ast.walk`` meets the outer first).
        scope: dict[int, str] = {}
        for outer in ast.walk(tree):
            if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
                scope.update((id(node), outer.name) for node in ast.walk(outer))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id == "HTTPError":
                given = next((k.value for k in node.keywords if k.arg == "code"), None)
            elif node.func.id == "ErrorKind" and len(node.args) == 3:
                given = node.args[-1]
            else:
                continue
            if (where, scope.get(id(node), "")) in COMPUTED_CODES:
                continue
            if given is None or None in _code_words(given):
                missing.append(f"{where}:{node.lineno} ({ast.unparse(node)[:60]})")
    assert not missing, "errors raised without a code:\n" + "\n".join(missing)


# Inline `name = value` spans that are no setting: formulas in formats.md and internals.md, and
# Ray Serve's own option.
NOT_SETTINGS = {"first", "k", "chunk_key", "max_replicas_per_node"}


def test_every_setting_named_in_toml_exists() -> None:
    """Each key of a ``toml`` block, at top level or in a ``[[models]]`` table, and each
    inline ``name = value`` span names a setting (``kvwarm.settings``)."""
    import tomllib

    from kvwarm.settings import ModelSettings, Settings
    from kvwarm.settings.types import ModelSpec

    top = set(Settings.model_fields)
    per_model = set(ModelSettings.model_fields) | {
        f for f in ModelSpec.__dataclass_fields__ if f != "options"
    }
    unknown = []
    for page in PAGES:
        text = text_of(page)
        for block in re.findall(r"^```toml\n(.*?)^```", text, re.S | re.M):
            data = tomllib.loads(block)
            data = data.get("kvwarm", data)
            unknown += [f"{page.name}: {k}" for k in data if k not in top]
            for table in data.get("models", []):
                unknown += [f"{page.name}: [[models]] {k}" for k in table if k not in per_model]
        for name in re.findall(r"`([a-z_][a-z0-9_]*) = [^`]*`", FENCE.sub("", text)):
            if name not in top | per_model | NOT_SETTINGS:
                unknown.append(f"{page.name}: {name}")
    assert not unknown, unknown


def test_every_file_named_exists() -> None:
    """A path in backticks (`tests/server/test_metrics.py`, `server/keepalive.py`,
    `routing/facts.py`) names a file of the repository: from its root, from ``src/`` or
    ``src/kvwarm/``, or as the tail of a path under them (a page's own context)."""
    files = [
        p.relative_to(ROOT).as_posix()
        for top in ("src", "tests", "bench", "docs")
        for p in (ROOT / top).rglob("*")
        if p.is_file()
    ]
    path = re.compile(
        r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|toml|json|js|html|css))(?![\w/])"
    )
    missing = sorted(
        {
            f"{page.name}: {name}"
            for page in PAGES
            for span in INLINE.findall(text_of(page))
            for name in path.findall(span)
            if not (ROOT / name).exists() and not any(f.endswith("/" + name) for f in files)
        }
    )
    assert not missing, missing


# Files the pages name that are other projects': Python's startup hook, llama.cpp's script.
FOREIGN_FILES = {"sitecustomize.py", "convert_lora_to_gguf.py"}


def test_every_bare_file_name_named_exists() -> None:
    """A file named without its directory (`engine.py` beside `engine/api.py`, `chat.js`,
    `test_tier_chunks.py`) is the name of some file of ``src/``, ``tests/`` or ``bench/``."""
    names = {p.name for top in ("src", "tests", "bench") for p in (ROOT / top).rglob("*")}
    bare = re.compile(r"(?<![\w./-])([\w.-]+\.(?:py|js|css|html))(?![\w/])")
    missing = sorted(
        {
            f"{page.name}: {name}"
            for page in PAGES
            for span in INLINE.findall(FENCE.sub("", text_of(page)))
            for name in bare.findall(span)
            if name not in names and name not in FOREIGN_FILES
        }
    )
    assert not missing, missing


def test_architecture_md_places_every_module() -> None:
    """docs/architecture.md's map names every module of ``src/kvwarm``: a line of it names the
    module's file with its directory (`engine/worker/tick.py`, or `tick.py` on a line naming
    `engine/worker/`; a package by its directory, `cli/*.py` for all of one), so a module
    added without a place on the map fails here."""
    src = ROOT / "src" / "kvwarm"
    lines = text_of(ROOT / "docs" / "architecture.md").splitlines()
    unplaced = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        folder, _, name = rel.rpartition("/")
        if name in ("__main__.py", "_version.py") and not folder:
            continue
        if name == "__init__.py":
            wanted = [f"`{folder}/" if folder else "kvwarm"]
        else:
            wanted = [rel, f"{folder}/*.py"] if folder else [name]
        placed = any(w in line for w in wanted for line in lines) or (
            name != "__init__.py"
            and folder
            and any(
                f"{folder}/" in line and re.search(rf"`{re.escape(name)}`", line) for line in lines
            )
        )
        if not placed:
            unplaced.append(rel)
    assert not unplaced, unplaced


def test_every_route_named_exists() -> None:
    """A path the pages name under one of the server's top-level segments (`/v1/...`,
    `/cache/...`, `curl localhost:8000/...`) is a route of ``create_app`` (or a family of
    routes: `/cache/*`, `/admin/models`), and `GET`/`POST`/`DELETE` before it is a method the
    route takes. `{param}` and UPPER-CASE placeholders match any segment."""
    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    app = create_app(Settings(backend="stub", models=(ModelSpec(path="stub-a"),), cache_dir=None))
    methods: dict[str, set[str]] = {"/": {"get"}, "/docs": {"get"}, "/openapi.json": {"get"}}
    with warnings.catch_warnings():  # FastAPI's note on /health's GET and HEAD sharing an id
        warnings.simplefilter("ignore", UserWarning)
        paths = app.openapi()["paths"]
    for path, item in paths.items():
        methods.setdefault(path, set()).update(item)
    tops = {path.split("/")[1] for path in methods if path != "/"}
    patterns = {
        path: re.compile(
            "^"
            + "/".join("[^/]+" if s.startswith("{") else re.escape(s) for s in path.split("/"))
            + "$"
        )
        for path in methods
    }
    named = re.compile(r"(?:\b(GET|POST|DELETE|HEAD)\s+)?(?:localhost:8000)?(/[\w.{}/-]*)")
    wrong = []
    for page in PAGES:
        for line in code_lines(page):
            for method, raw in named.findall(line):
                path = raw.rstrip("/.") or "/"
                if path.split("/")[1] not in tops or not (
                    line.startswith(raw) or "localhost:8000" in line or method
                ):
                    continue
                concrete = re.sub(r"\{[^}/]+\}|\b[A-Z][A-Z_]+\b", "X", path)
                hits = [p for p, rx in patterns.items() if rx.match(concrete)]
                family = any(p.startswith(path + "/") for p in methods)
                if not hits and not family:
                    wrong.append(f"{page.name}: {method} {path}".replace(":  ", ": "))
                elif method and hits and not any(method.lower() in methods[p] for p in hits):
                    wrong.append(f"{page.name}: {method} {path} (takes {sorted(methods[hits[0]])})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_client_examples_run() -> None:
    """The README's and server.md's examples with the official `openai` and `anthropic`
    clients run as written against a server (the stub backend under the embedded model's
    name), and say what their text says: asked again, `cached_tokens` grows, and a Responses
    follow-up restores its previous turn (its `instructions` resent: they are not carried
    over, and without them it restored a handful of tokens)."""
    import contextlib
    import io

    from tests.server.conftest import LiveServer, stub_settings

    from kvwarm.settings import ModelSpec

    blocks = [
        (page.name, block)
        for page in (ROOT / "README.md", ROOT / "docs" / "server.md")
        for block in re.findall(r"^```python\n(.*?)^```", text_of(page), re.S | re.M)
        if "OpenAI(" in block or "Anthropic(" in block or "client.responses" in block
    ]
    assert len(blocks) >= 3, [name for name, _ in blocks]
    model = ModelSpec(path="stub-a", id="smollm2-135m-instruct")
    server = LiveServer(stub_settings(models=(model,), allowed_hosts=())).start()
    try:
        ns: dict[str, Any] = {}
        runs: list[tuple[str, dict[str, Any]]] = []
        with contextlib.redirect_stdout(io.StringIO()):
            for name, block in blocks + blocks[:2]:  # the first two again: "ask again"
                code = block.replace("http://127.0.0.1:8000", server.base_url)
                exec(compile(code, name, "exec"), ns)
                runs.append((name, dict(ns)))
    finally:
        server.stop()
    chat = [run for _, run in runs if "r" in run and hasattr(run["r"], "choices")]
    claude = [run for _, run in runs if "m" in run]
    first, again = (
        run["r"].usage.prompt_tokens_details.cached_tokens for run in (chat[0], chat[-1])
    )
    assert again > first, (first, again)
    first, again = (run["m"].usage.cache_read_input_tokens for run in (claude[0], claude[-1]))
    assert again > first, (first, again)
    r1, r2 = ns["r1"], ns["r2"]
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens


def curl_examples() -> Iterator[tuple[str, str, str, str | None, object]]:
    """Each ``curl`` of an ``sh`` block: (page, method, path and query, body, the response
    shown after it as ``# {...}`` comment lines, or None)."""
    for page in PAGES:
        for block in re.findall(r"^```sh\n(.*?)^```", text_of(page), re.S | re.M):
            command: list[str] = []
            shown: list[str] = []
            for line in [*block.splitlines(), "#"]:
                if line.startswith("# ") and command and (shown or line.startswith("# {")):
                    shown.append(line[2:])
                elif line.startswith(("curl", "#")):
                    if command:
                        text = "\n".join(command)
                        method = re.search(r"-X (\w+)", text)
                        path = re.search(r"localhost:8000(/[^\s']*)", text)
                        body = re.search(r"-d '(.*?)'", text, re.S)
                        assert path, text
                        yield (
                            page.name,
                            method.group(1) if method else ("POST" if body else "GET"),
                            path.group(1),
                            body.group(1) if body else None,
                            json.loads(" ".join(shown)) if shown else None,
                        )
                    command, shown = ([line] if line.startswith("curl") else []), []
                elif command:
                    command.append(line)


def shape(value: object) -> object:
    """A JSON value's keys, recursively (a list by its first item), without the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def _curl_examples_wrong(
    client: Any, examples: list[tuple[str, str, str, str | None, object]]
) -> list[str]:
    """The examples (but those naming a placeholder, `KEY`) ``client`` does not answer 200,
    or, where the page shows the response, with one of another shape."""
    wrong = []
    for page, method, path, body, response in examples:
        if re.search(r"\b[A-Z]{2,}\b", path):
            continue
        answer = client.request(method, path, content=body, headers=JSON_HEADERS)
        if answer.status_code != 200 or (
            response is not None and shape(answer.json()) != shape(response)
        ):
            wrong.append(f"{page}: {method} {path}: {answer.status_code} {answer.text}")
    return wrong


def test_the_curl_examples_answer_as_shown(tmp_path: Path) -> None:
    """Every ``curl`` of an ``sh`` block (but one naming a placeholder, `KEY`) is answered 200
    by a stub server under the example's model names, and where the page shows the response,
    with one of that shape (the same fields, nested alike)."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import stub_settings, wait_ready

    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec

    examples = list(curl_examples())
    shown = {path for _, _, path, _, response in examples if response is not None}
    assert shown >= {"/v1/rerank", "/cache/prewarm"}, shown
    models = (
        ModelSpec(path="stub-a", id="smollm2-135m-instruct"),
        ModelSpec(path="stub-reranker.gguf", id="qwen3-reranker"),
    )
    settings = stub_settings(models=models, cache_dir=tmp_path / "cache")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        wrong = _curl_examples_wrong(client, examples)
    assert not wrong, "\n".join(wrong)


@pytest.mark.model
def test_the_curl_examples_answer_as_shown_on_the_embedded_model(tmp_path: Path) -> None:
    """The same on the embedded model under the server's own cache policy (`--policy`'s
    default: rows of 64 tokens or more), for every example but those naming another model
    (the reranker's). Found by the docs run: the stub reads a token a byte and its tests lower
    the policy to 16 tokens, so operations.md's `/cache/prewarm` of "You are ..." passed there,
    while on SmolLM2 its 8 tokens were a 400 (`min_tokens (64)`)."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import wait_ready

    from kvwarm.embedded import default_model_path
    from kvwarm.server import create_app
    from kvwarm.settings import ModelSpec, Settings

    model = "smollm2-135m-instruct"
    examples = [
        example
        for example in curl_examples()
        if example[3] is None or json.loads(example[3]).get("model", model) == model
    ]
    assert "/cache/prewarm" in {path for _, _, path, _, _ in examples}
    settings = Settings(
        models=(ModelSpec(path=str(default_model_path()), id=model),),
        cache_dir=tmp_path / "cache",
        n_ctx=1024,
        n_parallel=1,
        keepalive_interval_s=0,
        allowed_hosts=("testserver",),
    )
    assert settings.policy.min_tokens == 64  # the server's default, which the pages name
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        wrong = _curl_examples_wrong(client, examples)
    assert not wrong, "\n".join(wrong)


def _setting_of_flag() -> dict[str, str]:
    """Every settings flag of ``kvwarm serve`` and ``kvwarm cluster`` (short ones and
    ``--no-api-docs`` included): the setting it sets."""
    known = parsers()
    return {
        flag: action.dest
        for words in (("serve",), ("cluster",))
        for action in known[words]._actions
        for flag in action.option_strings
        if flag != "--config" and action.dest not in ("help", "verbose")
    }


def test_configuration_md_tables_pair_each_setting_with_its_own_flags_and_default() -> None:
    """Besides "Every setting" (``settings_reference``, checked in tests/cli), the pages'
    tables of settings name a setting, its flags, or both, and its default: each flag must set
    that row's setting (not merely exist), each default be the code's, and each flag of the
    "Model settings" table (which says each may be set per model) a per-model setting's."""
    from kvwarm.settings import Settings, default_text
    from kvwarm.settings.model import ModelSettings

    of_flag = _setting_of_flag()
    page = (ROOT / "docs" / "configuration.md").read_text()
    wrong: list[str] = []
    checked = 0
    for section in re.split(r"^## ", page, flags=re.M)[1:]:
        title = section.splitlines()[0]
        if title == "Every setting":
            continue
        for line in section.splitlines():
            if not line.startswith("| `"):
                continue
            first, second = (c.strip() for c in line.strip().strip("|").split(" | ")[:2])
            spans = INLINE.findall(first)
            names = [s for s in spans if re.fullmatch(r"[a-z][a-z0-9_]*", s)]
            flags = [w for s in spans for w in s.split() if re.fullmatch(r"--?[a-z][a-z-]*", w)]
            for flag in flags:
                checked += 1
                setting = of_flag.get(flag)
                if setting is None:
                    wrong.append(f"{title}: {flag} is no flag of kvwarm serve or cluster")
                elif names and setting not in names:
                    wrong.append(f"{title}: {flag} sets {setting}, not {names}")
                elif title == "Model settings" and setting not in ModelSettings.model_fields:
                    wrong.append(f"{title}: {flag} ({setting}) is not a per-model setting")
            for name in names:
                checked += 1
                if name not in Settings.model_fields:
                    wrong.append(f"{title}: {name} is no setting")
                elif second.strip("`") != default_text(name):
                    wrong.append(f"{title}: {name}'s default is {default_text(name)}, not {second}")
    assert checked > 60, checked  # the tables were found
    assert not wrong, "\n".join(wrong)


def test_a_flag_given_with_its_variable_or_toml_key_is_that_settings() -> None:
    """Prose that spells one setting three ways, ```--mmproj PATH` (`KVWARM_MMPROJ`, TOML
    `mmproj`...)`` or ```draft_model = "..."` (`--draft-model` ...)``: the spellings must be
    one setting's."""
    from kvwarm.settings import env_var

    of_flag = _setting_of_flag()
    pairs = [
        (r"`(--[a-z-]+)[^`]*` \(`(KVWARM_[A-Z0-9_]+)`", "env"),
        (r"`([a-z][a-z0-9_]*) = [^`]*` \(`(--[a-z-]+)`", "toml-flag"),
        (r"`(--[a-z-]+)[^`]*` \(`([a-z][a-z0-9_]*)` in TOML", "flag-toml"),
        (r"`(--[a-z-]+)[^`]*` \(`KVWARM_[A-Z0-9_]+`, TOML `([a-z][a-z0-9_]*)`", "flag-toml"),
    ]
    wrong: list[str] = []
    found = 0
    for page in PAGES:
        text = text_of(page)
        for pattern, kind in pairs:
            for a, b in re.findall(pattern, text):
                found += 1
                if kind == "env":
                    setting = of_flag.get(a)
                    if setting is None or env_var(setting) != b:
                        wrong.append(f"{page.name}: {a} and {b}")
                elif kind == "toml-flag":
                    if of_flag.get(b) != a:
                        wrong.append(f"{page.name}: {a} and {b}")
                elif of_flag.get(a) != b:
                    wrong.append(f"{page.name}: {a} and {b}")
    assert found >= 3, found
    assert not wrong, "\n".join(wrong)
