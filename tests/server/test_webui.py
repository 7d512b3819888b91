"""The web page's serving (server/webui/__init__.py) and the data it reads, without a browser.

The page itself runs in Chromium in ``test_webui_browser.py``; here: the files, their headers,
that nothing but them can be fetched, that keys and the guard treat the page as intended, and
the ``/cache/slots`` and ``/cache/stats`` fields the dashboard draws.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.cluster.eventlog import EventLog
from kvwarm.cluster.routing import ClusterIndex
from kvwarm.server import create_app
from kvwarm.server.webui import CSP, load_static

from .conftest import stub_settings, wait_ready

STATIC = Path(__file__).parents[2] / "src" / "kvwarm" / "server" / "webui" / "static"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings())) as test_client:
        wait_ready(test_client.get)
        yield test_client


class _Refs(HTMLParser):
    """Scripts, stylesheets and style attributes of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.urls: list[str] = []
        self.inline_styles = 0
        self.handlers: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "script":
            self.scripts.append(named)
        for name in ("src", "href"):
            value = named.get(name)
            if value and tag in ("script", "link"):
                self.urls.append(value)
        self.inline_styles += "style" in named or tag == "style"
        self.handlers += [name for name in named if name.startswith("on")]


def _page_refs(html: str) -> _Refs:
    refs = _Refs()
    refs.feed(html)
    return refs


def test_root_serves_the_page_with_a_strict_csp(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert csp == CSP
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    for name in ("script-src", "style-src", "connect-src"):
        assert directives[name] == "'self'", name  # no 'unsafe-inline', no other origin
    assert directives["frame-ancestors"] == "'none'"
    # No sink takes a string (innerHTML...), and no policy may be made to pass one.
    assert directives["require-trusted-types-for"] == "'script'"
    assert directives["trusted-types"] == "'none'"
    assert response.headers["x-content-type-options"] == "nosniff"
    refs = _page_refs(response.text)
    # No inline script, style or handler: the CSP would block them, so none may exist.
    assert refs.scripts and all(s.get("src") for s in refs.scripts)
    assert refs.inline_styles == 0 and refs.handlers == []


def test_every_referenced_file_resolves_with_its_type(client: TestClient) -> None:
    refs = _page_refs(client.get("/").text)
    wanted = set(refs.urls)
    # JS modules import their siblings: follow the imports too.
    for name in sorted(p.name for p in STATIC.glob("*.js")):
        source = (STATIC / name).read_text()
        wanted |= {"/ui/" + m for m in re.findall(r'from "\./([\w.-]+)"', source)}
    assert {"/ui/main.js", "/ui/app.css", "/ui/chat.js", "/ui/dashboard.js"} <= wanted
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for url in sorted(wanted):
        response = client.get(url)
        assert response.status_code == 200, url
        assert response.headers["content-type"].startswith(types[Path(url).suffix]), url
        assert response.headers["content-security-policy"] == CSP


def test_no_file_reaches_outside_the_page(client: TestClient) -> None:
    """Offline-safe and self-contained: no URL to another origin in any shipped file."""
    for path in STATIC.iterdir():
        text = path.read_text()
        external = re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}", text)
        # The SVG's XML namespace is a name, not a fetch.
        assert [u for u in external if u != "http://www.w3.org"] == [], path.name


@pytest.mark.parametrize(
    "path",
    [
        "/ui/..%2Fwebui.py",
        "/ui/..%2F..%2Fsettings.py",
        "/ui/%2e%2e%2fapp.py",
        "/ui/../webui.py",
        "/ui/static/index.html",
        "/ui/webui.py",
        "/ui/index.html%00.py",
        "/ui/",
        "/ui//etc/passwd",
        "/ui/%2Fetc%2Fpasswd",
    ],
)
def test_traversal_and_unknown_names_are_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404, path
    assert response.json()["error"]["code"] == "not_found"
    assert "import " not in response.text


def test_only_flat_known_files_are_served(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text("<p>hi</p>")
    (tmp_path / "notes.py").write_text("secret = 1")
    (tmp_path / ".hidden.js").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.js").write_text("x")
    table = load_static(tmp_path)
    assert set(table) == {"page.html"}
    assert table["page.html"] == (b"<p>hi</p>", "text/html; charset=utf-8")
    assert load_static(tmp_path / "missing") == {}


def test_the_page_needs_no_key_but_its_calls_do() -> None:
    with TestClient(create_app(stub_settings(api_key="sesame", admin_key="root"))) as secured:
        wait_ready(secured.get)
        assert secured.get("/").status_code == 200
        assert secured.get("/ui/main.js").status_code == 200
        config = secured.get("/ui/config.json").json()
        assert config["apiKey"] is True and config["adminKey"] is True
        assert "sesame" not in secured.get("/ui/config.json").text
        assert secured.get("/v1/models").status_code == 401
        stats = secured.get("/cache/stats", headers={"Authorization": "Bearer sesame"})
        assert stats.json()["error"]["code"] == "invalid_admin_key"
        slots = secured.get("/cache/slots", headers={"Authorization": "Bearer root"})
        assert slots.status_code == 200


def test_config_says_no_key_when_none_is_set(client: TestClient) -> None:
    config = client.get("/ui/config.json").json()
    assert config["apiKey"] is False
    assert config["cluster"] is False  # the page asks /cluster only behind kvwarm cluster


def test_the_page_origin_passes_the_guard(client: TestClient) -> None:
    # What the page's fetch sends: its own origin, the same Host.
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    own = {"Origin": "http://testserver", "Content-Type": "application/json"}
    assert client.post("/v1/chat/completions", json=body, headers=own).status_code == 200
    foreign = {"Origin": "http://evil.example", "Content-Type": "application/json"}
    assert client.post("/v1/chat/completions", json=body, headers=foreign).status_code == 403


def test_slots_show_what_each_slot_holds(client: TestClient) -> None:
    prompt = "The slots endpoint reports what each slot holds after a request ends."
    done = client.post("/v1/completions", json={"model": "b", "prompt": prompt, "max_tokens": 3})
    assert done.status_code == 200
    n_prompt = done.json()["usage"]["prompt_tokens"]
    data = client.get("/cache/slots").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"a", "b"}
    model = by_id["b"]
    assert model["requests"] >= 1 and model["prompt_tokens"] >= n_prompt
    assert len(model["slots"]) == model["n_parallel"]
    assert sorted(s["seq"] for s in model["slots"]) == list(range(model["n_parallel"]))
    holding = [s for s in model["slots"] if s["n_tokens"] > 0]
    # The finished request's slot keeps its sequence: prompt plus what was decoded.
    assert holding and all(s["phase"] == "idle" for s in model["slots"])
    assert max(s["n_tokens"] for s in holding) >= n_prompt
    assert all(s["cache_hit"] is None and s["prompt_tokens"] == 0 for s in model["slots"])


def test_stats_total_each_tier(client: TestClient) -> None:
    prompt = "Tier totals count the rows of each tier, their tokens and TTL classes, here."
    client.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": 2})
    stats = client.get("/cache/stats").json()
    tiers = stats["tiers"]
    assert tiers and sum(t["rows"] for t in tiers.values()) == stats["rows"]
    assert sum(t["tokens"] for t in tiers.values()) == stats["tokens"]
    assert sum(t["bytes"] for t in tiers.values()) == stats["bytes"]
    for name, totals in tiers.items():
        assert sum(totals["ttl_classes"].values()) == totals["rows"]
        assert f"tier_{name}_quota_bytes" in stats["counters"]  # the page's quota meter
    # Stored against logical bytes per memory kind (the stub models full attention here).
    kinds = stats["memory_kinds"]
    assert set(kinds) == {"full"} and kinds["full"]["rows"] == stats["rows"]
    assert kinds["full"]["bytes"] == stats["bytes"] > 0
    assert kinds["full"]["logical_bytes"] == stats["logical_bytes"]


def test_the_cluster_panel_draws_what_get_cluster_says(tmp_path: Path) -> None:
    """``cluster.js``'s cells for a ``/cluster`` body the router's index wrote (run in Node:
    the module touches no DOM until it renders)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on the PATH to run the page's modules")
    index = ClusterIndex()
    log = EventLog({"ram": ("replica", "memory")}, slots=2)
    index.observe(
        "SERVE_REPLICA::kvwarm#engine#ab12cd",
        "node-one-id-0123456789",
        {
            "events": log.report(),
            "pid": 4242,
            "in_flight": 1,
            "slots": 2,
            "ttft_ms": 35.0,
            "cache": {"ram": {"rows": 3.0}},
        },
        now=1000.0,
    )
    index.note_served("SERVE_REPLICA::kvwarm#engine#ab12cd", ("h",), b"k" * 32, 90)
    body = {"routing": "events", **index.describe()}
    script = tmp_path / "cells.mjs"
    module = json.dumps((STATIC / "cluster.js").as_uri())
    script.write_text(
        f"import {{ replicaCells, indexNote }} from {module};\n"
        f"const view = {json.dumps(body)};\n"
        "console.log(JSON.stringify({cells: replicaCells(view.replicas, 1060 * 1000), "
        "note: indexNote(view)}));\n"
    )
    out = json.loads(
        subprocess.run([node, str(script)], capture_output=True, check=True, text=True).stdout
    )
    (cells,) = out["cells"]
    texts = [c[0] for c in cells]
    assert texts[:5] == ["ab12cd", "node-one-id-", "4242", "running", "1 / 2"]
    assert texts[6] == "35 ms" and texts[7] == "ram 3" and texts[10] == "1"
    assert texts[12] == "1 min ago"
    assert out["note"].startswith("routing: events; index: 0 rows")


def test_the_dashboard_hit_rate_is_the_request_outcomes_of_cache_stats(
    client: TestClient, tmp_path: Path
) -> None:
    """``dashboard.js``'s hit rate over a live ``/cache/stats`` body (run in Node): requests
    that reused KV over all requests served, every hit of ``REQUEST_HITS`` in it
    (``hits_live`` too), so a new outcome cannot be left out of the page silently; a request
    that failed before it was seated (``admission_failures``) was not served: neither."""
    from kvwarm.cache.counters import REQUEST_HITS, REQUEST_OUTCOMES

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on the PATH to run the page's modules")
    body = {"model": "a", "prompt": "Hit rates count requests, not lookups.", "max_tokens": 2}
    for _ in range(2):  # a miss, then the slot's live KV
        assert client.post("/v1/completions", json=body).status_code == 200
    counters = client.get("/cache/stats").json()["counters"]
    hits = sum(counters[k] for k in REQUEST_HITS)
    assert counters["hits_live"] >= 1 and counters["misses"] >= 1
    script = tmp_path / "rate.mjs"
    module = json.dumps((STATIC / "dashboard.js").as_uri())
    script.write_text(
        f"import {{ lookupHitRate }} from {module};\n"
        f"const c = {json.dumps(counters)};\n"
        "const one = (k) => lookupHitRate({...c, [k]: c[k] + 1});\n"
        f"console.log(JSON.stringify({{rate: lookupHitRate(c), "
        f"bumped: {json.dumps(list(REQUEST_OUTCOMES))}.map(one)}}));\n"
    )
    run = subprocess.run([node, str(script)], capture_output=True, check=True, text=True)
    out = json.loads(run.stdout)
    total = hits + counters["misses"]
    assert out["rate"] == pytest.approx(hits / total)
    # One more of each outcome moves the rate as a hit or a miss would, or not at all.
    assert set(REQUEST_OUTCOMES) == {*REQUEST_HITS, "misses", "admission_failures"}
    expected = [
        hits / total if k == "admission_failures" else (hits + (k != "misses")) / (total + 1)
        for k in REQUEST_OUTCOMES
    ]
    assert out["bumped"] == pytest.approx(expected)


def test_the_dashboard_time_saved_uses_the_tokens_the_model_prefilled(
    client: TestClient, tmp_path: Path
) -> None:
    """``dashboard.js``'s prefill time saved (run in Node) over a live ``/cache/stats``
    body: cached tokens times the prefill time per token the model actually prefilled
    (``prefilled_tokens``). It divided by ``prompt_tokens - cached_tokens``, which also
    holds prompts never prefilled (a request cancelled while queued, or mid-prefill), so each
    such request lowered the time saved although no prefill time was spent on it."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on the PATH to run the page's modules")
    body = {"model": "a", "prompt": "Time saved counts the prefills run. " * 4, "max_tokens": 2}
    for _ in range(2):  # a cold prefill, then its reuse
        assert client.post("/v1/completions", json=body).status_code == 200
    totals = client.get("/cache/stats").json()["model_totals"]["a"]
    assert totals["cached_tokens"] > 0 and totals["prefilled_tokens"] > 0
    # A request cancelled while still queued: its prompt counted, none of it prefilled.
    cancelled = {**totals, "prompt_tokens": totals["prompt_tokens"] + 500}
    script = tmp_path / "saved.mjs"
    module = json.dumps((STATIC / "dashboard.js").as_uri())
    script.write_text(
        f"import {{ savings }} from {module};\n"
        f"const m = {json.dumps(totals)};\n"
        f"const c = {json.dumps(cancelled)};\n"
        "console.log(JSON.stringify([savings([m]).savedMs, savings([c]).savedMs]));\n"
    )
    run = subprocess.run([node, str(script)], capture_output=True, check=True, text=True)
    saved, with_cancelled = json.loads(run.stdout)
    per_token = totals["prefill_ms"] / totals["prefilled_tokens"]
    assert saved == pytest.approx(totals["cached_tokens"] * per_token)
    assert with_cancelled == pytest.approx(saved)
