"""Drives the compare page (``GET /compare``) in headless Chromium: the browser test and the
README's screenshot use this one module.

Chromium and its WebDriver come from the system (Debian: ``apt-get install chromium
chromium-driver``), Selenium from PyPI (``pip install selenium``, in the ``test``
extra); nothing is downloaded when a browser starts.

Take a screenshot of a running server's page::

    python -m deployments.browser --url http://127.0.0.1:8000/compare --out docs/compare.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BrowserUnavailable", "ColumnResult", "find_chromium", "chromium_driver", "read_column", "run_compare",
           "press_run", "main"]

_BROWSERS = ("chromium", "chromium-browser", "google-chrome")
_DRIVERS = ("chromedriver",)


class BrowserUnavailable(RuntimeError):
    """No headless Chromium can be started here (the message says what is missing)."""


@dataclass(frozen=True)
class ColumnResult:
    """What one column of the page shows once a run has ended."""

    state: str  # "done", "error", "running" (timed out) or "idle" (never started)
    text: str  # the streamed output
    steps: int  # step spans coloured (one verification step each, text-bearing steps only)
    bonus: int  # bonus-token marks
    stats: str  # the figures line under the column
    error: str  # the column's error message, if any
    visible: bool = True  # shown: a pane of a drafter the server loads (EAGLE-3's only where it has the head)


def find_chromium() -> tuple[str, str]:
    """Paths of a Chromium browser and its WebDriver ($DART_CHROMIUM / $DART_CHROMEDRIVER first, then PATH).

    Raises:
        BrowserUnavailable: either one is missing, or Selenium is not installed.
    """
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise BrowserUnavailable("selenium is not installed (pip install selenium)") from None
    browser = os.environ.get("DART_CHROMIUM") or next(filter(None, map(shutil.which, _BROWSERS)), None)
    driver = os.environ.get("DART_CHROMEDRIVER") or next(filter(None, map(shutil.which, _DRIVERS)), None)
    if not browser or not driver:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if not p)
        raise BrowserUnavailable(f"{missing} not found (Debian: apt-get install chromium chromium-driver)")
    return browser, driver


def chromium_driver(width: int = 1400, height: int = 1000):
    """A headless Chromium WebDriver with a fixed window size (close it with ``.quit()``).

    Raises:
        BrowserUnavailable: see :func:`find_chromium`, or the browser fails to start.
    """
    browser, driver = find_chromium()
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    try:
        return webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    except WebDriverException as e:
        raise BrowserUnavailable(f"chromium did not start: {e.msg}") from None


_READ_COLUMN = """
const col = document.querySelector(arguments[0]);
return {state: col.dataset.state || "idle", text: col.querySelector('.output').textContent,
        steps: new Set(Array.from(col.querySelectorAll('.output span'), s => s.dataset.step)).size,
        bonus: col.querySelectorAll('.output .bonus').length,
        stats: col.querySelector('.stats').textContent, error: col.querySelector('.error').textContent,
        visible: !col.hidden};
"""


def read_column(driver, selector: str) -> ColumnResult:
    """The state of one column (``#col-dart``, ``#col-eagle3`` or ``#col-ar``)."""
    return ColumnResult(**driver.execute_script(_READ_COLUMN, selector))


def run_compare(driver, url: str, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                timeout_s: float = 300.0, api_key: str | None = None) -> dict:
    """Opens the page, types the prompt (and ``api_key`` into the page's key field, for a server
    that asks for one), presses Run and waits until the run ends (every shown column done, or a message
    shown) or ``timeout_s`` passes.

    Returns:
        ``{"dart": ColumnResult, "eagle3": ColumnResult, "ar": ColumnResult, "message": str, "speedup": str,
        "model": str}`` (the EAGLE-3 pane is hidden and idle where the server loads no EAGLE-3 head).
    """
    from selenium.webdriver.common.by import By

    driver.get(url)
    deadline = time.monotonic() + timeout_s
    model = ""
    while time.monotonic() < deadline and not model:  # the page asks /v1/models on load
        model = driver.find_element(By.ID, "model").text.strip("…")
        if driver.find_element(By.ID, "message").text:
            break
        time.sleep(0.1)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    if prompt:
        box.send_keys(prompt)
    fields = (("max-tokens", max_tokens), ("temperature", temperature)) + ((("api-key", api_key),) if api_key else ())
    for name, value in fields:
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))
    return press_run(driver, max(deadline - time.monotonic(), 0.0)) | {"model": model}


def press_run(driver, timeout_s: float = 300.0) -> dict:
    """Presses Run on the page already open and waits until the run ends (every shown column
    done, or a message shown) or ``timeout_s`` passes.

    Returns:
        ``{"dart": ColumnResult, "eagle3": ColumnResult, "ar": ColumnResult, "message": str, "speedup": str}``.
    """
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    driver.find_element(By.ID, "run").click()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        message = driver.find_element(By.ID, "message").text
        cols = [read_column(driver, f"#col-{name}") for name in _COLUMNS]
        ended = message or (all(c.state == "done" for c in cols if c.visible)
                            and driver.find_element(By.ID, "speedup").text)
        if ended:
            break
    return {name: read_column(driver, f"#col-{name}") for name in _COLUMNS} | {
        "message": driver.find_element(By.ID, "message").text,
        "speedup": driver.find_element(By.ID, "speedup").text}


_COLUMNS = ("dart", "eagle3", "ar")  # the page's columns (#col-dart, ...), press_run's keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.browser", description=(
        "Runs one prompt on a running server's compare page in headless Chromium and saves a screenshot."))
    p.add_argument("--url", default="http://127.0.0.1:8000/compare", help="the page [%(default)s]")
    p.add_argument("--out", type=Path, default=Path("compare.png"), help="PNG file to write [%(default)s]")
    p.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number, "
                                       "with a docstring and three doctests.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1250)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every run [%(default)s]")
    args = p.parse_args(argv)
    try:
        driver = chromium_driver(args.width, args.height)
    except BrowserUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_compare(driver, args.url, args.prompt, max_tokens=args.max_tokens,
                             temperature=args.temperature, timeout_s=args.timeout)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
    summary = {k: (v.__dict__ if isinstance(v, ColumnResult) else v) for k, v in result.items()}
    for col in _COLUMNS:
        summary[col] = {k: v for k, v in summary[col].items() if k != "text"}
    print(json.dumps(summary | {"screenshot": str(args.out)}, indent=1, ensure_ascii=False))
    ok = all(result[col].state == "done" for col in _COLUMNS if result[col].visible)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
