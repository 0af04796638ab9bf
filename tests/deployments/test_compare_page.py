"""The compare page (``GET /`` and ``/compare``): served by the app from files in the package,
self-contained, and driven in headless Chromium (``browser`` marker) against the tiny served
model: every column (DART, EAGLE-3 where the server loads its head, autoregressive) fills with the
target's greedy text, steps are coloured, the bonus tokens are
marked, the figures and the speed-up appear; an empty prompt, a refused request, a server that
is gone and a stream cut short each show a message instead of a stuck page."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time

import httpx
import pytest

from deployments.browser import BrowserUnavailable, chromium_driver, press_run, run_compare
from deployments.ingress import compare_page

from .conftest import GUARDED_KEY, HTTP

PROMPT = "Name three colours."


def test_the_page_is_self_contained():
    html = compare_page()
    assert "<script>" in html and "v1/chat/completions" in html
    # no file from elsewhere: no src/href to another origin, no protocol-relative URL, no import
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)
    assert not re.search(r"""@import|import\s*\(|<link[^>]+stylesheet""", html, re.I)


@pytest.mark.slow
def test_the_app_serves_the_page(app):
    for path in ("/", "/compare"):
        r = httpx.get(f"{HTTP}{path}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert r.text == compare_page()


@pytest.fixture(scope="module")
def browser():
    try:
        driver = chromium_driver()
    except BrowserUnavailable as e:
        pytest.skip(f"no headless Chromium here: {e}")
    yield driver
    driver.quit()


@pytest.mark.slow
@pytest.mark.browser
def test_both_columns_fill_with_coloured_steps_and_figures(app, reference, browser):
    want = reference([{"role": "user", "content": PROMPT}], 24)
    result = run_compare(browser, f"{HTTP}/compare", PROMPT, max_tokens=24, timeout_s=180)
    dart, ar = result["dart"], result["ar"]
    assert result["message"] == "" and result["model"] == "tiny-dart"
    assert dart.state == ar.state == "done", (dart, ar)
    assert dart.text == ar.text == want  # greedy: both columns show the target's own text
    # every text-bearing step is a coloured span; speculative steps close with a marked bonus token
    assert dart.steps >= 2 and ar.steps >= 2 and dart.bonus >= 1 and ar.bonus == 0
    for col in (dart, ar):
        assert "tokens/s" in col.stats and "τ" in col.stats and "24 tokens" in col.stats
    assert "steps speculative" in dart.stats and "draft nodes" in dart.stats and "draft nodes" not in ar.stats
    assert "× the tokens/s of autoregressive decoding" in result["speedup"]
    assert "identical output" in result["speedup"]
    # this server loads no EAGLE-3 head: its pane is hidden and never runs
    assert not result["eagle3"].visible and result["eagle3"].state == "idle" and "EAGLE-3" not in result["speedup"]


@pytest.mark.slow
@pytest.mark.browser
def test_three_panes_where_the_server_loads_both_heads(both, reference, browser):
    """A server with a DART and an EAGLE-3 head: the page shows DART, EAGLE-3 and autoregressive
    panes, runs each (its request naming the method), all three show the target's greedy text with
    coloured steps, the speculative panes mark bonus tokens, and the speed-up line gives each
    drafter against autoregressive decoding and DART against EAGLE-3."""
    want = reference([{"role": "user", "content": PROMPT}], 24)
    result = run_compare(browser, f"{both}/compare", PROMPT, max_tokens=24, timeout_s=240)
    dart, eagle3, ar = result["dart"], result["eagle3"], result["ar"]
    assert result["message"] == "" and result["model"] == "both", result
    assert dart.visible and eagle3.visible and ar.visible
    assert dart.state == eagle3.state == ar.state == "done", (dart, eagle3, ar)
    assert dart.text == eagle3.text == ar.text == want
    for col in (dart, eagle3):
        assert col.steps >= 2 and col.bonus >= 1 and "steps speculative" in col.stats and "24 tokens" in col.stats
    assert ar.bonus == 0 and "draft nodes" not in ar.stats
    speedup = result["speedup"]
    assert "DART: " in speedup and "EAGLE-3: " in speedup and "DART ÷ EAGLE-3: " in speedup
    assert "identical output" in speedup


@pytest.mark.slow
@pytest.mark.browser
def test_a_server_with_an_api_key_is_asked_with_the_key(guarded, browser):
    """With ``DART_API_KEY`` set the page says the server wants a key (the 401 of its model query),
    a wrong key is refused with that message, and with the right key both columns run."""
    from selenium.webdriver.common.by import By

    wrong = run_compare(browser, f"{guarded}/compare", PROMPT, max_tokens=8, timeout_s=60, api_key="wrong")
    assert "401" in wrong["message"] and "API key" in wrong["message"], wrong
    browser.get(f"{guarded}/compare")  # on load, without a key: the model query's 401 is shown
    deadline = time.monotonic() + 30
    while not browser.find_element(By.ID, "message").text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "401" in browser.find_element(By.ID, "message").text
    result = run_compare(browser, f"{guarded}/compare", PROMPT, max_tokens=8, timeout_s=180, api_key=GUARDED_KEY)
    assert result["message"] == "" and browser.find_element(By.ID, "model").text == "guarded", result
    assert result["dart"].state == result["ar"].state == "done"
    assert result["dart"].text == result["ar"].text != ""


@pytest.mark.slow
@pytest.mark.browser
def test_an_empty_prompt_and_a_refused_request_show_a_message(app, browser):
    empty = run_compare(browser, f"{HTTP}/compare", "", timeout_s=30)
    assert "Enter a prompt" in empty["message"] and empty["dart"].state == empty["ar"].state == "idle"
    refused = run_compare(browser, f"{HTTP}/compare", PROMPT, max_tokens=1000, timeout_s=60)
    assert "HTTP 400" in refused["message"] and "limit" in refused["message"]
    assert refused["dart"].state == "error" and "limit" in refused["dart"].error
    assert refused["ar"].state == "idle"  # the second run never started


class _FakeServer(http.server.ThreadingHTTPServer):
    """Serves the page and a model list; its completions stream two chunks and then hang up."""

    daemon_threads = True


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/compare":
            self._send(200, "text/html; charset=utf-8", compare_page().encode())
        else:
            self._send(200, "application/json", json.dumps({"data": [{"id": "fake"}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for text in ("Red", ", green"):
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
                     "dart": {"tokens": 1, "accepted": 0, "draft_nodes": 0, "bonus_chars": 0, "prefill": False}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True  # gone before "data: [DONE]"


@pytest.fixture()
def fake_server():
    server = _FakeServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.browser
def test_a_stream_cut_short_and_a_server_gone_show_a_message(browser, fake_server):
    url = f"http://127.0.0.1:{fake_server.server_address[1]}/compare"
    cut = run_compare(browser, url, PROMPT, timeout_s=30)
    assert "ended before the server finished" in cut["message"]
    assert cut["dart"].state == "error" and cut["dart"].text == "Red, green"  # what came stays on the page
    fake_server.shutdown()
    fake_server.server_close()
    gone = press_run(browser, timeout_s=10)  # the page loaded from a server that has gone since
    assert "cannot reach the server" in gone["message"] and gone["dart"].state == "error"
