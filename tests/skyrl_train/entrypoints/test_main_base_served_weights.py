"""The served-weights check in a real launch on the builtin engine: a bf16 engine
passes it at the default bound with its routes replayed (the built-in model, and issue
38's top-2 Mixtral that the unreplayed check refused at the launch push), and a bound
below bf16's own error stops the run at the launch's push, naming the engine, before
any step trains. (vLLM, and the MoE reload bug it catches: test_main_base_vllm.py;
the check on a real engine and trainer alone: test_served_weights_engines.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from _e2e import SMALL, with_overrides

from inference.models.architecture import TinySizes
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.errors import ServedWeightsError
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

ENGINE = "generator.inference_engine"


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return with_overrides(
        SMALL,
        "trainer.ckpt_interval=0",
        "trainer.eval_interval=0",
        f"{ENGINE}.dtype=bfloat16",
        "logging.plot=false",
        f"trainer.run_dir={run_dir}",
        *extra,
    )


@pytest.mark.parametrize("model", ["builtin", "mixtral_top2"])
def test_a_bf16_engine_passes_at_the_default_bound(tmp_path: Path, model: str) -> None:
    extra = []
    if model == "mixtral_top2":
        # Issue 38: 6 experts, top-2, initializer_range 0.2; seed 2's probes hold one
        # that a near-tie flip moves by 0.18 under the trainer's own routing.
        sizes = TinySizes(num_experts_per_tok=2)
        folder = write_tiny_checkpoint("mixtral", tmp_path / "mixtral", seed=2, sizes=sizes)
        extra.append(f"model.path={folder}")
    with launch(load_config(overrides(tmp_path / "run", *extra))) as job:
        history = job.train()
    assert len(history) == 2
    for metrics in history:
        # bf16 against the fp32 trainer, routes replayed: not equal, well inside 0.1.
        assert metrics["served_weights/replayed_routes"] == 1.0, metrics
        assert 0 < metrics["served_weights/median_abs_logp_diff"] < 0.1, metrics
    log = (tmp_path / "run" / "main_base.log").read_text()
    assert "served weights of policy version 0: " in log  # the launch's push, checked


def test_a_bound_below_the_engines_error_stops_the_run_at_the_launch_push(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ServedWeightsError) as info:
        with launch(
            load_config(overrides(run_dir, f"{ENGINE}.verify_weights_tolerance=1e-6"))
        ) as job:
            url = job.server_urls[0]
            job.train()
    err = info.value
    assert err.url == url and err.policy_version == 0
    assert str(err).startswith(f"engine {url} after the push of policy version 0: ")
    assert f"{ENGINE}.verify_weights_tolerance: expected every probe's median" in str(err)
    assert "(engine routes replayed)" in str(err)
    assert "worst: probe " in str(err)
    assert not ray.is_initialized()
    # Stopped before step 1 trained: no metrics line was written.
    assert not (run_dir / "metrics.jsonl").exists() or read_metrics(run_dir / "metrics.jsonl") == []
