"""scripts/compare_r3.py's per-seed check, the one command behind the README's learning
figures: a seed passes when its final greedy eval reward clears the bar and sits no
more than ``--max-drop`` below its own best; a failing seed makes the exit status 1,
and ``--replot`` reruns the check on saved histories without training."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_r3.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_r3", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses look their module up while the class is made.
    sys.modules["compare_r3"] = module
    spec.loader.exec_module(module)
    return module


def _history(evals: dict[int, float], steps: int = 30) -> list[dict[str, float]]:
    # Entry i is step i + 1; evaluations only on some steps, as in a run.
    return [
        {"reward/mean": 0.1, **({"eval/reward_mean": evals[s]} if s in evals else {})}
        for s in range(1, steps + 1)
    ]


def test_a_seed_passes_on_its_final_value_and_its_drop_from_its_best() -> None:
    compare = _module()
    late_collapse = _history({10: 0.3, 20: 0.42, 30: 0.244})  # the run in issue 29
    steady = _history({10: 0.2, 20: 0.6, 30: 0.55})
    below_bar = _history({10: 0.2, 20: 0.45, 30: 0.45})
    results = compare.seed_results([late_collapse, steady, below_bar])
    assert [(r.seed, r.final, r.best, r.best_step) for r in results] == [
        (0, 0.244, 0.42, 20),
        (1, 0.55, 0.6, 20),
        (2, 0.45, 0.45, 20),
    ]
    assert [r.passes(bar=0.5, max_drop=0.1) for r in results] == [False, True, False]
    assert results[0].drop == pytest.approx(0.176)


def test_a_run_that_never_evaluated_is_an_error_not_a_pass() -> None:
    compare = _module()
    with pytest.raises(ValueError, match="seed 1: expected eval/reward_mean"):
        compare.seed_results([_history({10: 0.6}), _history({})])


def test_replot_exits_1_when_a_seed_fails(tmp_path: Path) -> None:
    histories = tmp_path / "histories.json"
    histories.write_text(
        json.dumps({"r3": [_history({10: 0.6, 30: 0.7}), _history({10: 0.6, 30: 0.3})]})
    )
    args = [sys.executable, str(SCRIPT), "--replot", "--histories", str(histories)]
    out = subprocess.run(
        [*args, "--png", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stderr
    assert "seed 0: final 0.700, best 0.700 (step 30), drop 0.000  pass" in out.stdout
    assert "seed 1: final 0.300, best 0.600 (step 10), drop 0.300  FAIL" in out.stdout
    assert (tmp_path / "c.png").is_file()
    passing = subprocess.run(
        [*args, "--png", str(tmp_path / "d.png"), "--bar", "0.2", "--max-drop", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert passing.returncode == 0, passing.stderr


def test_strategy_runs_every_arm_on_that_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    compare = _module()
    seen: list[tuple[str, bool]] = []

    def fake_run(cfg):  # type: ignore[no-untyped-def]
        seen.append((cfg.trainer.strategy, cfg.trainer.policy.routing_replay.enabled))
        return _history({1: 0.6}, steps=1)

    monkeypatch.setattr(compare, "run", fake_run)
    argv = ["compare_r3.py", "--seeds", "2", "--arms", "r3,no_r3", "--strategy", "fsdp"]
    monkeypatch.setattr(sys, "argv", [*argv, "--png", str(tmp_path / "c.png"), "--json"])
    compare.main()
    assert seen == [("fsdp", True), ("fsdp", False)] * 2
    out = capsys.readouterr().out  # each run's "done:" line, then the JSON
    assert json.loads(out[out.index("\n{") :])["overrides"] == ["trainer.strategy=fsdp"]
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "tpu"])
    with pytest.raises(SystemExit):
        compare.main()
    assert "--strategy: invalid choice: 'tpu'" in capsys.readouterr().err


def test_final_and_best_eval_are_reduced_apart() -> None:
    """Both rows read eval/reward_mean; the best once overwrote the final in the summary."""
    compare = _module()
    reduced = compare.reduce_history(_history({10: 0.6, 20: 0.8, 30: 0.7}))
    assert reduced["eval/reward_mean"] == 0.7
    assert reduced["eval/reward_mean_best"] == 0.8


def test_runs_finishing_out_of_order_are_kept_in_seed_order_with_no_gap() -> None:
    """``--jobs``: seed 2 may finish before seed 1; the histories (and a --resume) only
    ever hold seeds 0..n-1, so seed 2 waits until seed 1 is in."""
    compare = _module()
    first = _history({1: 0.1}, steps=1)
    order = compare.SeedOrder(["r3", "no_r3"], {"r3": [first]})
    assert order.missing(3) == [(0, "no_r3"), (1, "r3"), (1, "no_r3"), (2, "r3"), (2, "no_r3")]
    runs = {seed: _history({1: seed / 10}, steps=1) for seed in range(3)}
    order.add("r3", 2, runs[2])
    order.add("no_r3", 0, runs[0])
    assert order.histories == {"r3": [first], "no_r3": [runs[0]]}
    order.add("r3", 1, runs[1])
    assert order.histories["r3"] == [first, runs[1], runs[2]]
    assert order.missing(3) == [(1, "no_r3"), (2, "no_r3")]
