"""The viewer's page in Chromium, used as a person would: it opens with no console
errors and no network, its plots show every step, a click on a trajectory shows its
tokens coloured by their dumped values, runs overlay, damaged dumps show a message
naming the file, and the served page works as the file does."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from skyrl_train.entrypoints.view import main
from skyrl_train.runs.rollouts import dump_path, read_dump, write_dump
from skyrl_train.viewer.synthetic import make_run, step_document
from tests.skyrl_train.viewer._browser import (
    expected_colour,
    launch,
    open_page,
    parse_rgb,
    wait_ready,
)

STEPS = 12


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """run_a: 12 steps, a dump each step and an eval dump every 5; step 1 has a
    trajectory without trainer log-probs and one with a null advantage and flips; step 3's dump is torn,
    step 4's from an older format. run_b: 8 steps."""
    root = tmp_path_factory.mktemp("viewer")
    run_a = make_run(root / "run_a", steps=STEPS, eval_every=5)
    first = step_document(1)
    first["trajectories"][2]["trainer_logprobs"] = None
    first["trajectories"][5]["advantages"][0] = None
    first["trajectories"][5]["router_flips"][1] = [2]
    first["trajectories"][5]["router_flips_native"][1] = [1, 3]
    write_dump(run_a, first)
    torn = dump_path(run_a, 3, "train")
    torn.write_bytes(torn.read_bytes()[:60])
    old = dump_path(run_a, 4, "train")
    body = orjson.loads(gzip.decompress(old.read_bytes()))
    old.write_bytes(gzip.compress(orjson.dumps({**body, "version": 0})))
    assert main([str(run_a)]) == 0
    run_b = make_run(root / "run_b", steps=8, seed=1)
    assert main([str(run_a), str(run_b), "--out", str(root / "both")]) == 0
    return {"run_a": run_a, "run_b": run_b, "both": root / "both"}


def url(folder: Path, fragment: str = "") -> str:
    return (folder / "index.html").resolve().as_uri() + fragment


def plots(page: Any) -> dict[str, list[dict[str, Any]]]:
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('.plot')].map((div) =>
            [div.dataset.panel, div.data.map((t) => ({name: t.name, n: t.x.length}))]))"""
    )


def tokens(page: Any) -> list[dict[str, Any]]:
    return page.evaluate(
        """() => [...document.querySelectorAll('.response .tok')].map((s) => ({
            text: s.textContent, data: {...s.dataset}, obs: s.classList.contains('obs'),
            background: getComputedStyle(s).backgroundColor}))"""
    )


def test_the_page_opens_offline_with_every_step_plotted(
    browser: Any, runs: dict[str, Path]
) -> None:
    opened = open_page(browser, url(runs["run_a"] / "view"))
    wait_ready(opened.page)
    assert opened.errors() == [] and opened.network == []
    shown = plots(opened.page)
    assert shown["reward"] == [
        {"name": "train", "n": STEPS},
        {"name": "eval (greedy)", "n": 1},  # eval metrics every 10 steps
    ]
    assert [t["n"] for t in shown["time per step (s)"]] == [STEPS] * 3
    assert {"policy entropy (nats/token)", "router agreement with the rollout"} <= set(shown)
    position = opened.page.text_content("#step-position")
    assert position == f"1 of {STEPS} dumped train steps ({STEPS} steps in metrics)"
    assert opened.page.locator(".traj-card").count() == 8
    assert opened.page.locator(".group").count() == 2
    heatmap = opened.page.evaluate("() => document.getElementById('expert-load').data[0]")
    assert (
        heatmap["type"] == "heatmap"
        and heatmap["z"] == read_dump(dump_path(runs["run_a"], 1, "train"))["expert_load"]
    )
    opened.page.close()


def check_colours(page: Any, trajectory: dict[str, Any], mode: str) -> int:
    """Every token's background against the page's scale of its dumped value; returns
    how many were coloured."""
    page.check(f"input[name='colour'][value='{mode}']")
    shown = tokens(page)
    assert [t["text"] for t in shown] == [
        t.replace("\n", "↵\n") or "∅" for t in trajectory["tokens"]
    ]
    coloured = 0
    for i, token in enumerate(shown):
        policy = trajectory["loss_mask"][i] == 1
        assert token["obs"] is not policy
        value = None
        if policy and mode == "diff" and trajectory["trainer_logprobs"] is not None:
            value = abs(trajectory["rollout_logprobs"][i] - trajectory["trainer_logprobs"][i])
        elif policy and mode == "advantage":
            value = trajectory["advantages"][i]
        want, got = expected_colour(mode, value), parse_rgb(token["background"])
        if want is None:
            assert got is None, (i, token)
        else:
            coloured += 1
            assert (
                got is not None and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1
            ), (i, token, want)
    return coloured


def test_a_trajectory_shows_its_tokens_coloured_by_their_values(
    browser: Any, runs: dict[str, Path]
) -> None:
    opened = open_page(browser, url(runs["run_a"] / "view"))
    wait_ready(opened.page)
    page = opened.page
    dumped = read_dump(dump_path(runs["run_a"], 1, "train"))["trajectories"]
    page.click(".traj-card[data-index='5']")
    traj = dumped[5]
    first = page.locator(".response .tok").first
    assert first.get_attribute("data-id") == str(traj["response_ids"][0])
    assert float(first.get_attribute("data-rollout-logprob")) == traj["rollout_logprobs"][0]
    assert first.get_attribute("data-advantage") is None  # dumped as null
    policy = sum(traj["loss_mask"])
    assert check_colours(page, traj, "diff") == policy
    assert check_colours(page, traj, "advantage") == policy - 1  # the null one is not
    page.hover(".response .tok[data-index='1']")
    detail = page.text_content("#token-detail")
    assert "router flips (trained)layers 2" in detail
    assert "router flips (native)layers 1, 3" in detail
    assert f"id{traj['response_ids'][1]}" in detail
    assert page.get_attribute(".response .tok[data-index='1']", "data-flips-native") == "1,3"
    page.click(".traj-card[data-index='2']")  # no trainer log-probs: nothing coloured
    assert check_colours(page, dumped[2], "diff") == 0
    assert opened.errors() == []
    page.close()


def test_paging_through_steps_and_damaged_dumps(browser: Any, runs: dict[str, Path]) -> None:
    view = runs["run_a"] / "view"
    (view / "data" / "r0" / "train_000006.js").unlink()  # a page whose data went missing
    opened = open_page(browser, url(view, "#step=2"))
    wait_ready(opened.page)
    page = opened.page

    def state() -> tuple[str, str, str]:
        page.wait_for_selector("body:not([data-step-state='loading'])")
        message = page.text_content("#step-message") if page.is_visible("#step-message") else ""
        return (
            page.input_value("#step-input"),
            page.get_attribute("body", "data-step-state"),
            message,
        )

    assert state() == ("2", "ready", "")
    torn = dump_path(runs["run_a"], 3, "train")
    assert f"{torn}: expected a whole gzip file" in page.text_content("#warnings")
    page.click("#next-step")
    step, status, message = state()
    assert (step, status) == (
        "3",
        "error",
    ) and f"step 3 (train): {torn}: expected a whole gzip file" in message
    page.click("#next-step")
    step, status, message = state()
    assert (step, status) == (
        "4",
        "error",
    ) and f"{dump_path(runs['run_a'], 4, 'train')}: expected version 1" in message
    page.click("#next-step")
    assert state() == ("5", "ready", "")
    page.click("#next-step")
    step, status, message = state()
    assert (step, status) == (
        "6",
        "error",
    ) and "data/r0/train_000006.js: could not be loaded" in message
    page.fill("#step-input", "11")
    page.press("#step-input", "Enter")
    assert state() == ("11", "ready", "")
    # A click on a plot's point opens the dumped step nearest it.
    page.evaluate(
        """() => { const div = document.querySelector(".plot[data-panel='reward']");
                   div.emit('plotly_click', {points: [{data: div.data[0], x: 8}]}); }"""
    )
    assert state() == ("8", "ready", "")
    page.check("input[name='kind'][value='eval']")
    assert state() == ("10", "ready", "")  # the eval dump nearest step 11
    assert page.text_content("#step-position").startswith("2 of 2 dumped eval steps")
    page.click(".traj-card[data-index='0']")
    assert page.locator(".response .tok").count() > 0
    # Only the missing script's load failure reaches the console.
    assert [e for e in opened.errors() if "ERR_FILE_NOT_FOUND" not in e] == []
    page.close()
    assert main([str(runs["run_a"])]) == 0  # rewritten for the other tests


def test_two_runs_overlay(browser: Any, runs: dict[str, Path]) -> None:
    opened = open_page(browser, url(runs["both"]))
    wait_ready(opened.page)
    page = opened.page
    assert plots(page)["policy entropy (nats/token)"] == [
        {"name": "run_a", "n": STEPS},
        {"name": "run_b", "n": 8},
    ]
    legend = page.locator(
        ".plot[data-panel='policy entropy (nats/token)'] .legendtext"
    ).all_text_contents()
    assert legend == ["run_a", "run_b"]
    page.select_option("#run-select", "1")
    page.wait_for_selector("body[data-step-state='ready']")
    assert page.text_content("#step-position") == "1 of 8 dumped train steps (8 steps in metrics)"
    assert opened.errors() == []
    page.close()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_served_page_works_as_the_file_does(browser: Any, runs: dict[str, Path]) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "skyrl_train.entrypoints.view", str(runs["run_b"]), "--serve", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # A child inherits an ignored SIGINT (a background shell, or a test before this
        # one), and Python then leaves Ctrl-C ignored: the server would never stop.
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + server.stderr.read()
        opened = open_page(browser, line.split()[1])
        wait_ready(opened.page)
        opened.page.click(".traj-card[data-index='3']")
        dumped = read_dump(dump_path(runs["run_b"], 1, "train"))["trajectories"][3]
        assert check_colours(opened.page, dumped, "advantage") == sum(dumped["loss_mask"])
        assert opened.errors() == []
        assert {u.split("/", 3)[3] for u in opened.network} >= {
            "",
            "data/manifest.js",
            "data/r0/train_000001.js",
        }
        assert all(u.startswith("http://127.0.0.1:") for u in opened.network)
        opened.page.close()
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0


def test_a_page_missing_its_files_says_which(
    browser: Any, runs: dict[str, Path], tmp_path: Path
) -> None:
    page_dir = tmp_path / "page"
    assert main([str(runs["run_b"]), "--out", str(page_dir)]) == 0
    (page_dir / "assets" / "plotly.min.js").unlink()
    opened = open_page(browser, url(page_dir))
    page = opened.page
    page.wait_for_selector("body[data-fatal='1']")
    assert page.text_content("#fatal").startswith("assets/plotly.min.js: could not be loaded")
    page.wait_for_selector("body[data-step-state='ready']")
    page.click(".traj-card[data-index='0']")  # the rollouts work without Plotly
    assert page.locator(".response .tok").count() > 0
    (page_dir / "data" / "manifest.js").unlink()
    page.reload()
    page.wait_for_selector("body[data-fatal='1']")
    assert page.text_content("#fatal").startswith("data/manifest.js did not load")
    page.close()
