"""Time the run viewer's page in Chromium on synthetic runs of 150 and 10,000 steps.

    python scripts/bench_viewer.py                       # both runs, ~1-2 min on 2 cores
    python scripts/bench_viewer.py --steps 150 --opens 1 # a quick one
    python scripts/bench_viewer.py --screenshot docs/viewer.png

Each run (``skyrl_train.viewer.synthetic.make_run``) has metrics for every step and a
train dump every ``--dump-every`` steps (1 for 150 steps, 10 for 10,000 by default)
plus an eval dump every 10; the page is written with ``python -m
skyrl_train.entrypoints.view`` (timed: first write, then a rewrite that reuses the
dumps' scripts), then opened ``--opens`` times in a fresh tab. Printed per open, in
ms from the start of navigation (the page's own performance.now()): the first step's
trajectories listed, the first plot drawn, every plot drawn, and a trajectory's tokens
shown after a click on it made as soon as the list showed (Plotly starting up, about a
second, delays that click); then the mean time for "next step" (a click, the step's
dump loaded, one of its trajectories opened). Nothing is asserted; the
issue's target is a 150-step run open in under 2 s. Chromium is the distribution's
(``apt-get install chromium``), driven by Playwright.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from skyrl_train.entrypoints.view import main as view
from skyrl_train.utils.cpu_topology import cpu_model
from skyrl_train.viewer.synthetic import make_run


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def open_once(browser: Any, url: str, *, pages: int) -> dict[str, float]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("body[data-step-state='ready']", timeout=120_000)
    page.click(".traj-card[data-index='1']")  # as soon as the step's cards show
    page.wait_for_selector(".response .tok")
    page.wait_for_selector("body[data-metrics-ready='1']", timeout=120_000)
    timings = page.evaluate("window.__skyrlTimings")
    steps = []
    for _ in range(pages):
        start = time.perf_counter()
        page.click("#next-step")
        page.wait_for_selector("body[data-step-state='ready']")
        page.click(".traj-card[data-index='1']")
        page.wait_for_selector(".response .tok")
        steps.append(time.perf_counter() - start)
    page.close()
    if errors:
        raise SystemExit(f"page errors: {errors}")
    return {
        "step_ms": timings["firstStep"],
        "first_plot_ms": timings["firstPlot"],
        "all_plots_ms": timings["allPlots"],
        "trajectory_ms": timings["firstTrajectory"],
        "next_step_ms": 1000 * statistics.mean(steps) if steps else float("nan"),
    }


def screenshot(browser: Any, url: str, out: Path) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_selector("body[data-metrics-ready='1']")
    page.wait_for_selector("body[data-step-state='ready']")
    page.click(".traj-card[data-index='1']")
    flipped = page.locator(".response .tok.flipped").first
    (flipped if flipped.count() else page.locator(".response .tok").first).click()
    page.screenshot(path=str(out), full_page=True)
    page.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[150, 10_000])
    parser.add_argument(
        "--dump-every", type=int, default=None, help="default: 1 up to 150 steps, else 10"
    )
    parser.add_argument("--opens", type=int, default=3)
    parser.add_argument("--pages", type=int, default=5, help="'next step' clicks timed per open")
    parser.add_argument("--screenshot", type=Path, help="save a screenshot of the first run's page")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    print(f"CPU: {cpu_model()}")
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for n, steps in enumerate(args.steps):
            every = args.dump_every or (1 if steps <= 150 else 10)
            start = time.perf_counter()
            run = make_run(Path(tmp) / f"run_{steps}", steps=steps, dump_every=every)
            built = time.perf_counter() - start
            writes = []
            for _ in range(2):
                start = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    assert view([str(run)]) == 0
                writes.append(time.perf_counter() - start)
            dumps = len(list((run / "rollouts").iterdir()))
            print(
                f"{steps} steps, {dumps} dumps ({folder_size(run / 'rollouts') / 1e6:.2f} MB); "
                f"synthetic run {built:.1f} s; page written in {writes[0]:.2f} s, "
                f"rewritten in {writes[1]:.2f} s ({folder_size(run / 'view') / 1e6:.1f} MB)"
            )
            url = (run / "view" / "index.html").as_uri()
            for i in range(args.opens):
                t = open_once(browser, url, pages=args.pages)
                print(
                    f"  open {i + 1}: step's trajectories listed {t['step_ms']:.0f} ms, first "
                    f"plot {t['first_plot_ms']:.0f} ms, all plots {t['all_plots_ms']:.0f} ms, "
                    f"a trajectory's tokens shown {t['trajectory_ms']:.0f} ms; next step "
                    f"{t['next_step_ms']:.0f} ms"
                )
            if args.screenshot and n == 0:
                shot = make_run(Path(tmp) / "runs" / "r3_grpo", steps=steps, dump_every=every)
                with contextlib.redirect_stdout(io.StringIO()):
                    assert view([str(shot)]) == 0
                screenshot(browser, (shot / "view" / "index.html").as_uri(), args.screenshot)
                print(f"screenshot: {args.screenshot}")
        browser.close()


if __name__ == "__main__":
    main()
