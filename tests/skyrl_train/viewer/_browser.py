"""Chromium for the viewer's browser tests: the distribution's package driven by
Playwright from PyPI. Absent, the tests skip saying why, unless SKYRL_REQUIRE_BROWSER
is set (CI sets it after installing chromium), when they fail."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


def chromium_or_skip() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    problem = None
    if path is None:
        problem = "no chromium on PATH (apt-get install -y chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "playwright is not installed (pip install -e '.[dev]')"
    if problem:
        if os.environ.get("SKYRL_REQUIRE_BROWSER"):
            pytest.fail(f"SKYRL_REQUIRE_BROWSER is set but {problem}")
        pytest.skip(problem)
    assert path is not None
    return path


def launch() -> Iterator[Any]:
    """One browser for a test module (starting Chromium costs about a second)."""
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Opened:
    page: Any
    console: list[str] = field(default_factory=list)
    network: list[str] = field(default_factory=list)

    def errors(self) -> list[str]:
        return [m for m in self.console if m.startswith(("error:", "pageerror:"))]


def open_page(browser: Any, url: str) -> Opened:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    opened = Opened(page)
    page.on("console", lambda m: opened.console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: opened.console.append(f"pageerror: {e}"))
    page.on("request", lambda r: opened.network.append(r.url) if r.url.startswith("http") else None)
    page.goto(url)
    return opened


def wait_ready(page: Any) -> None:
    page.wait_for_selector("body[data-metrics-ready='1']", timeout=30_000)
    page.wait_for_selector(
        "body[data-step-state='ready'], body[data-step-state='error']", timeout=30_000
    )


# The page's colour scales (skyrl_train/viewer/static/colours.js), written again here.
WHITE = (255, 255, 255)
DIFF_STOPS = ((0.0, WHITE), (0.5, (253, 174, 97)), (1.0, (165, 0, 38)))


def _mix(a: tuple[int, ...], b: tuple[int, ...], t: float) -> tuple[int, ...]:
    return tuple(math.floor(x + (y - x) * t + 0.5) for x, y in zip(a, b, strict=True))


def expected_colour(mode: str, value: float | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if mode == "diff":
        t = min(1.0, max(0.0, math.log10(max(value, 1e-3) / 1e-3) / 3))
        for (t0, c0), (t1, c1) in zip(DIFF_STOPS, DIFF_STOPS[1:], strict=False):
            if t <= t1:
                return _mix(c0, c1, (t - t0) / (t1 - t0))
        return DIFF_STOPS[-1][1]
    t = min(1.0, max(-1.0, value / 2))
    return _mix(WHITE, (215, 48, 39), -t) if t < 0 else _mix(WHITE, (26, 152, 80), t)


def parse_rgb(css: str) -> tuple[int, ...] | None:
    """``rgb(1, 2, 3)`` as a triple; a transparent background as None."""
    if css in ("rgba(0, 0, 0, 0)", "transparent", ""):
        return None
    inner = css[css.index("(") + 1 : css.index(")")]
    return tuple(int(float(v)) for v in inner.split(",")[:3])
