"""The web page in a real headless Chromium (Playwright), against a live server on the
embedded model: chat turns show their cached tokens, the dashboard follows the cache, keys are
asked once, the page works from the keyboard and at phone width, with no console errors.

Playwright drives the system's Chromium (``make browser`` installs Debian's when it can;
Playwright's own browser download may be unreachable). Only a missing browser skips these
tests. A failing test leaves a full-page screenshot in its ``tmp_path`` (the path is in the
failure message).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

from kvwarm.settings import ModelSpec

from .conftest import LiveServer, stub_settings
from .test_live_openai import real_settings

pytestmark = [pytest.mark.model, pytest.mark.slow]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TURN_TIMEOUT_MS = 180_000  # a turn prefills and decodes on 2 shared cores
PHONE = {"width": 375, "height": 740}


def chromium_path() -> str | None:
    """``$KVWARM_CHROMIUM``, else ``chromium`` on the PATH, else Debian's path."""
    for candidate in (
        os.environ.get("KVWARM_CHROMIUM"),
        shutil.which("chromium"),
        "/usr/bin/chromium",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no Chromium found ($KVWARM_CHROMIUM, chromium on PATH, /usr/bin/chromium); "
            "`make browser` installs Debian's as root"
        )
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(real_settings(tmp_path_factory.mktemp("webui") / "cache")).start()
    try:
        yield live
    finally:
        live.stop()


class Console:
    """Every console error and uncaught exception of a page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "assert"):
            self.errors.append(message.text)


@contextmanager
def screenshot_on_failure(page: Page, path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        page.screenshot(path=str(path), full_page=True)
        exc.add_note(f"screenshot of the page: {path}")
        raise


def open_page(browser: Browser, url: str, **context: object) -> tuple[Page, Console]:
    page = browser.new_context(**context).new_page()  # type: ignore[arg-type]
    console = Console(page)
    page.goto(url)
    return page, console


def tab_to(page: Page, element_id: str, limit: int = 40) -> None:
    """Press Tab until ``element_id`` has the focus: it must be reachable by keyboard."""
    for _ in range(limit):
        if page.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"#{element_id} is not reachable with Tab")


def stat(page: Page, element_id: str) -> float:
    value = page.get_attribute(f"#{element_id}", "data-value")
    return float(value) if value else float("nan")


def wait_for(page: Page, predicate_js: str, arg: object = None, timeout: int = 30_000) -> None:
    page.wait_for_function(predicate_js, arg=arg, timeout=timeout)


def wait_rows_above(page: Page, n: float) -> None:
    """Until the dashboard's row count (it polls every 2 s) exceeds ``n``."""
    wait_for(page, "n => Number(document.getElementById('stat-rows').dataset.value) > n", n)


def send_turn(page: Page, text: str, turn: int) -> dict[str, int]:
    """Type a message and press Enter, keyboard only; the finished turn's numbers."""
    tab_to(page, "tab-chat")
    page.keyboard.press("Enter")
    tab_to(page, "prompt")
    page.keyboard.type(text)
    page.keyboard.press("Enter")
    selector = f"li.turn[data-turn='{turn}'][data-cached-tokens]"
    page.wait_for_selector(selector, timeout=TURN_TIMEOUT_MS)
    data = page.eval_on_selector(selector, "node => ({...node.dataset})")
    return {k: int(v) for k, v in data.items() if k.endswith(("Tokens", "Ms"))}


def show_dashboard(page: Page) -> None:
    tab_to(page, "tab-cache")
    page.keyboard.press("Enter")
    page.wait_for_selector("#view-cache:not([hidden])")


def test_two_turns_show_the_cache_at_work(
    browser: Browser, server: LiveServer, tmp_path: Path
) -> None:
    page, console = open_page(browser, server.base_url + "/")
    with screenshot_on_failure(page, tmp_path / "two-turns.png"):
        page.wait_for_selector("body[data-ready='true']")
        assert page.eval_on_selector_all("#model option", "o => o.length") == 1
        page.fill("#max-tokens", "8")
        page.fill("#temperature", "0")

        show_dashboard(page)
        wait_for(page, "() => document.getElementById('stat-rows').dataset.value !== undefined")
        rows_at_start = stat(page, "stat-rows")
        assert rows_at_start == 0  # a fresh cache directory

        first = send_turn(page, "Name one colour of the sky.", 1)
        assert first["promptTokens"] > 0 and first["ttftMs"] > 0
        assert first["cachedTokens"] + first["prefilledTokens"] == first["promptTokens"]

        show_dashboard(page)
        wait_rows_above(page, rows_at_start)
        rows_after_first = stat(page, "stat-rows")

        second = send_turn(page, "And one colour of grass?", 2)
        # The second turn's prompt starts with the whole first turn: the cache serves it.
        assert second["cachedTokens"] > 0, second
        assert second["promptTokens"] > first["promptTokens"]
        bar = page.locator("li.turn[data-turn='2'] .bar .cached").bounding_box()
        assert bar is not None and bar["width"] > 0  # the cached part of the bar is drawn
        legend = page.inner_text("li.turn[data-turn='2'] .n-cached")
        assert legend.startswith(f"{second['cachedTokens']:,} cached")
        # Under each bar, why the rest was prefilled (timings.cache_reason, issue 25).
        reason = "li.turn[data-turn='{}']"
        assert page.get_attribute(reason.format(1), "data-cache-reason") == "no_prefix"
        assert page.get_attribute(reason.format(2), "data-cache-reason") == "new_tokens"
        why = page.inner_text(reason.format(2) + " .reason")
        assert why.startswith("Prefilled because: the rest of the prompt was never cached")

        show_dashboard(page)
        wait_rows_above(page, rows_after_first)
        wait_for(page, "() => Number(document.getElementById('stat-token-rate').dataset.value) > 0")
        # Every tier of the server is listed, and the slot that served us holds tokens.
        assert page.locator("#tiers tbody tr[data-tier='disk']").count() == 1
        assert page.locator("#slots table").count() == 1
        assert page.locator("#rows table tbody tr").count() >= 1
        chart_drawn = page.evaluate(
            """() => { const c = document.getElementById('chart-hits');
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       return d.some((v, i) => i % 4 === 3 && v > 0); }"""
        )
        assert chart_drawn
        assert console.errors == []


def test_phone_width_and_keyboard_focus(
    browser: Browser, server: LiveServer, tmp_path: Path
) -> None:
    page, console = open_page(browser, server.base_url + "/", viewport=PHONE)
    with screenshot_on_failure(page, tmp_path / "phone.png"):
        page.wait_for_selector("body[data-ready='true']")
        overflow = "() => document.documentElement.scrollWidth - window.innerWidth"
        assert page.evaluate(overflow) <= 0
        tab_to(page, "model")
        outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
        assert outline not in ("", "none")  # the focus is visible
        show_dashboard(page)
        wait_for(page, "() => document.getElementById('stat-rows').dataset.value !== undefined")
        assert page.evaluate(overflow) <= 0
        assert console.errors == []


def test_keys_are_asked_once_per_session(browser: Browser, tmp_path: Path) -> None:
    settings = real_settings(tmp_path / "cache").replace(api_key="sesame", admin_key="root")
    live = LiveServer(settings).start()
    try:
        page, console = open_page(browser, live.base_url + "/#cache")
        with screenshot_on_failure(page, tmp_path / "keys.png"):
            # Asked before the first call (no 401 is ever provoked): the API key first ...
            page.wait_for_selector("#key-dialog[open]")
            assert page.inner_text("#key-label") == "API key"
            assert page.evaluate("document.activeElement.id") == "key-input"
            page.keyboard.type("sesame")
            page.keyboard.press("Enter")
            # ... then the admin key, which the dashboard's /cache/* calls need.
            wait_for(page, "() => document.getElementById('key-label').textContent === 'Admin key'")
            page.wait_for_selector("#key-dialog[open]")
            page.keyboard.type("root")
            page.keyboard.press("Enter")
            page.wait_for_selector("body[data-ready='true']")
            wait_for(page, "() => document.getElementById('stat-rows').dataset.value === '0'")
            assert page.eval_on_selector_all("#model option", "o => o.length") == 1
            stored = page.evaluate(
                "['kvwarm.apiKey', 'kvwarm.adminKey'].map(k => sessionStorage.getItem(k))"
            )
            assert stored == ["sesame", "root"]
            page.reload()
            page.wait_for_selector("body[data-ready='true']")
            assert not page.is_visible("#key-dialog")  # kept for the session: not asked again
            wait_for(page, "() => document.getElementById('stat-rows').dataset.value === '0'")
            assert page.eval_on_selector_all("#model option", "o => o.length") == 1
            assert console.errors == []
    finally:
        live.stop()


def test_no_string_becomes_markup_or_script_on_the_page(browser: Browser, tmp_path: Path) -> None:
    """The page is the server's origin: a model's reply or a cached row's name that became
    markup there could drive every endpoint. Beyond its own rule (text by ``textContent``),
    its CSP requires Trusted Types with no policy allowed, so the browser refuses any string
    sink, whatever a later change to the page does. (``eval`` is refused by the CSP too, but
    not to code the test runs through the DevTools protocol, so it is not checked here.)"""
    live = LiveServer(stub_settings()).start()
    try:
        page, _console = open_page(browser, live.base_url + "/")
        with screenshot_on_failure(page, tmp_path / "trusted-types.png"):
            page.wait_for_selector("body[data-ready='true']")
            outcome = page.evaluate(
                """() => {
                    const attempt = (f) => {
                        try { f(); return "ran"; } catch (e) { return e.name; }
                    };
                    const box = document.createElement("div");
                    return {
                        html: attempt(() => { box.innerHTML = "<img src=x>"; }),
                        adjacent: attempt(() => box.insertAdjacentHTML("beforeend", "<b>x</b>")),
                        policy: attempt(() => trustedTypes.createPolicy("p", {})),
                        text: attempt(() => { box.textContent = "<b>x</b>"; }),
                    };
                }"""
            )
            assert outcome == {
                "html": "TypeError",
                "adjacent": "TypeError",
                "policy": "TypeError",
                "text": "ran",
            }, outcome
    finally:
        live.stop()


def test_a_declined_admin_key_is_not_asked_again_and_the_keys_button_sets_it(
    browser: Browser, tmp_path: Path
) -> None:
    """With both keys set, cancelling the dashboard's admin key prompt leaves a status that
    says to use the Keys button (found by review: the prompt came back at every 2 s poll), and
    that button asks for the admin key too (it asked for the API key alone, so the admin key
    could not be set with it)."""
    live = LiveServer(stub_settings(api_key="sesame", admin_key="root")).start()
    try:
        page, console = open_page(browser, live.base_url + "/#cache")
        with screenshot_on_failure(page, tmp_path / "declined.png"):
            page.wait_for_selector("#key-dialog[open]")
            assert page.inner_text("#key-label") == "API key"
            page.keyboard.type("sesame")
            page.keyboard.press("Enter")
            wait_for(page, "() => document.getElementById('key-label').textContent === 'Admin key'")
            page.wait_for_selector("#key-dialog[open]")
            page.click("#key-cancel")
            status = "document.getElementById('dash-status').textContent"
            wait_for(page, f"() => {status}.endsWith('(use the Keys button)')")
            first = page.evaluate(status)
            # The next polls run (their status carries the time) and ask nothing.
            wait_for(page, f"s => {status} !== s", first, timeout=10_000)
            assert not page.is_visible("#key-dialog")
            assert page.evaluate(status).endswith("(use the Keys button)")
            page.click("#key-button")
            page.wait_for_selector("#key-dialog[open]")
            assert page.inner_text("#key-label") == "API key"
            page.click("#key-cancel")  # keeps the stored API key
            wait_for(page, "() => document.getElementById('key-label').textContent === 'Admin key'")
            page.wait_for_selector("#key-dialog[open]")
            page.keyboard.type("root")
            page.keyboard.press("Enter")
            wait_for(page, "() => document.getElementById('stat-rows').dataset.value === '0'")
            stored = page.evaluate(
                "['kvwarm.apiKey', 'kvwarm.adminKey'].map(k => sessionStorage.getItem(k))"
            )
            assert stored == ["sesame", "root"]
            # The hit rate counts requests (each one outcome), not lookups (found by review:
            # the chart still named its series "lookups" after the counters were reworked).
            chart = "() => document.getElementById('chart-hits').getAttribute('aria-label')"
            wait_for(page, f"() => ({chart})().includes(' %')")
            assert page.evaluate(chart).startswith("Hit rate over time: requests ")
            assert page.inner_text("#chart-hits + figcaption").startswith(
                "Hit rate: requests that reused KV, prompt tokens"
            )
            assert console.errors == []
    finally:
        live.stop()


def test_the_models_view_loads_unloads_and_shows_memory(browser: Browser, tmp_path: Path) -> None:
    """The Models tab (stub models: fast): each model's status, when it unloads (pinned:
    never), its memory with its cache share, and Load/Unload buttons that work from the
    keyboard (issue 41)."""
    models = (
        ModelSpec(path="stub-a", id="a", options=(("pinned", True),)),
        ModelSpec(path="stub-b", id="b"),
    )
    live = LiveServer(stub_settings(models=models, model_idle_unload_s=600)).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            body = {"model": "a", "prompt": "A lighthouse keeper and a cat " * 4, "max_tokens": 4}
            assert http.post("/v1/completions", json=body).status_code == 200
        page, console = open_page(browser, live.base_url + "/#models", viewport=PHONE)
        with screenshot_on_failure(page, tmp_path / "models.png"):
            page.wait_for_selector("body[data-ready='true']")
            row = "#models-table tr[data-model='{}']"
            page.wait_for_selector(row.format("a") + "[data-status='ready']")
            page.wait_for_selector(row.format("b") + "[data-status='ready']")
            cells = page.eval_on_selector(
                row.format("a"), "r => [...r.cells].map(c => c.textContent)"
            )
            assert cells[2] == "pinned" and cells[3].endswith("MiB")  # weights
            assert page.inner_text(row.format("b") + " td:nth-child(3)").startswith("in ")
            # The cache share of a (it served the request), none of b.
            wait_for(
                page,
                "s => Number(document.querySelector(s).dataset.value) > 0",
                row.format("a") + " td.cache",
            )
            assert page.get_attribute(row.format("b") + " td.cache", "data-value") == "0"
            # Unload b, then load it again, from the keyboard.
            for _ in range(40):  # Tab to the button: reachable by keyboard
                label = (
                    "document.activeElement && document.activeElement.getAttribute('aria-label')"
                )
                if page.evaluate(label) == "Unload b":
                    break
                page.keyboard.press("Tab")
            else:
                raise AssertionError("the Unload button is not reachable with Tab")
            page.keyboard.press("Enter")
            page.wait_for_selector(row.format("b") + "[data-status='available']")
            assert page.inner_text("#models-status").startswith("b is available")
            page.click("[aria-label='Load b']")
            page.wait_for_selector(row.format("b") + "[data-status='ready']")
            overflow = "() => document.documentElement.scrollWidth - window.innerWidth"
            assert page.evaluate(overflow) <= 0
            assert console.errors == []
    finally:
        live.stop()


@pytest.fixture(scope="module")
def seeing_server() -> Iterator[LiveServer]:
    """The stub backend with a projector: the page's image path without a model to wait on."""
    from kvwarm.settings import ModelSpec

    from .conftest import stub_settings

    spec = ModelSpec(path="stub-eye", id="eye", options=(("mmproj", Path("stub-mmproj.gguf")),))
    live = LiveServer(stub_settings(models=(spec,), max_body_bytes=1 << 20)).start()
    try:
        yield live
    finally:
        live.stop()


def test_an_image_attached_to_a_turn_stays_in_the_conversation(
    browser: Browser, seeing_server: LiveServer, tmp_path: Path
) -> None:
    from tests.engine.mediakit import png

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(1))
    page, console = open_page(browser, seeing_server.base_url + "/")
    with screenshot_on_failure(page, tmp_path / "image-turn.png"):
        page.wait_for_selector("body[data-ready='true']")
        page.fill("#max-tokens", "8")
        page.fill("#temperature", "0")
        page.set_input_files("#attach", str(picture))
        assert page.inner_text("#attached").startswith("picture.png")
        first = send_turn(page, "What is in it?", 1)
        assert "Image: picture.png" in page.inner_text("#transcript li.msg.user")
        assert page.input_value("#attach") == ""  # sent with that turn only
        second = send_turn(page, "And its colours?", 2)
        # The image went again with the conversation, and came from the cache with it.
        assert second["cachedTokens"] >= first["promptTokens"], (first, second)
        assert console.errors == []


def test_the_dashboard_keeps_its_totals_when_models_unload_and_shows_restores_and_quotas(
    browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stub models (fast). Found by review: the tokens served from the cache and the time
    saved came from the loaded models only, so they went blank once every model that served
    had unloaded; the tier table had no restores (its hits are rows opened, for LFU); the
    quota meter measured against the configured quota, not the one the free space on the
    disk tier's filesystem allows."""
    from types import SimpleNamespace

    free = 3 << 20
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)
    )
    settings = stub_settings(cache_dir=tmp_path / "cache", disk_quota_bytes=1 << 30)
    live = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            body = {"model": "a", "prompt": "A lighthouse keeper and a cat " * 4, "max_tokens": 4}
            unload = {"model": "a"}
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.post("/admin/models/unload", json=unload).status_code == 200
            # Loaded again: its prompt comes from a tier (a restore), then it unloads again.
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.post("/admin/models/unload", json=unload).status_code == 200
            stats = http.get("/cache/stats").json()
        restored = {t: v["restores"] for t, v in stats["tiers"].items() if v["restores"]}
        assert restored, stats["tiers"]
        page, console = open_page(browser, live.base_url + "/")
        with screenshot_on_failure(page, tmp_path / "totals.png"):
            page.wait_for_selector("body[data-ready='true']")
            show_dashboard(page)
            wait_for(page, "() => document.getElementById('stat-rows').dataset.value > 0")
            # Model a is gone; what it served from the cache still counts.
            assert stat(page, "stat-token-rate") > 0
            assert stat(page, "stat-saved") > 0
            row = "#tiers tr[data-tier='{}']"
            for tier, n in restored.items():
                cell = page.locator(row.format(tier) + " td.restores")
                assert cell.get_attribute("data-value") == str(n)
                assert cell.inner_text().split()[0] == str(n)
                assert cell.inner_text().endswith(" ms")  # its bytes, their average time
            quota = page.locator(row.format("disk") + " td.quota")
            used = stats["tiers"]["disk"]["bytes"]
            assert quota.get_attribute("data-value") == str(used + free)
            assert quota.inner_text().split() == ["3.0", "MiB", "of", "1.0", "GiB"]
            meter = page.locator(row.format("disk") + " meter")
            assert meter.get_attribute("max") == str(used + free)
            assert console.errors == []
    finally:
        live.stop()
