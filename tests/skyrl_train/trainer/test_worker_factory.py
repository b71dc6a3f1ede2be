"""``workers/factory.py`` builds the backend ``trainer.strategy`` names, with the run's
settings: the FSDP worker from the model folder the trainer passes, the Megatron worker
with the run's replay mode in its node, both with ``trainer.remove_microbatch_padding``;
the FSDP branch loads no Megatron module.

The worker classes are replaced by recorders (a unit test of the dispatch, one layer):
the workers themselves are tested in tests/skyrl_train/workers/."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _stand_in_worker import ARCHITECTURE, StandInWorker

from skyrl_train.config import load_config
from skyrl_train.config.schema import PPOConfig
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers import factory

REPO = Path(__file__).resolve().parents[3]


class Recorder(StandInWorker):
    """Takes any constructor arguments and keeps them; ``setup`` returns itself."""

    built: list[Recorder] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs
        Recorder.built.append(self)

    def setup(self) -> Recorder:
        return self


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    monkeypatch.setattr(Recorder, "built", [])
    return Recorder


def _build(cfg: PPOConfig, checkpoint: str = "/models/tiny") -> Any:
    return factory.build_worker(
        cfg, architecture=ARCHITECTURE, checkpoint=checkpoint, pad_token_id=7
    )


def test_fsdp_builds_the_fsdp_worker_from_the_model_folder(
    monkeypatch: pytest.MonkeyPatch, recorder: type[Recorder]
) -> None:
    from skyrl_train.workers.fsdp import worker as fsdp_worker

    monkeypatch.setattr(fsdp_worker, "FSDPPolicyWorker", recorder)
    cfg = load_config(
        [
            "trainer.strategy=fsdp",
            "trainer.seed=3",
            "trainer.policy.fsdp_config.reshard_after_forward=false",
            "trainer.policy.routing_replay.enabled=false",
            "generator.sampling_params.temperature=0.7",
            "trainer.remove_microbatch_padding=true",
        ]
    )
    built = _build(cfg)
    assert recorder.built == [built]
    assert built.args == ("/models/tiny", ARCHITECTURE, cfg.trainer.policy.fsdp_config)
    assert built.kwargs == {
        # The run's schedule: the config's null decay is the run's remaining updates.
        "optimizer": dataclasses.replace(
            cfg.trainer.policy.optimizer_config, lr_decay_steps=150 * 8 - 800
        ),
        "seed": 3,
        "pad_token_id": 7,
        "temperature": 0.7,
        "routing_replay": False,
        "remove_microbatch_padding": True,
    }


@pytest.mark.filterwarnings("ignore:trainer.policy.megatron_config:FutureWarning")
@pytest.mark.parametrize(
    ("overrides", "enabled", "source"),
    [
        ([], True, "rollout"),
        (["trainer.policy.routing_replay.enabled=false"], False, "rollout"),
        (["trainer.policy.routing_replay.source=old_policy"], True, "old_policy"),
        # An old launch script's alias reaches the worker through the node.
        (["trainer.policy.megatron_config.moe_enable_routing_replay=false"], False, "rollout"),
    ],
)
def test_megatron_gets_the_runs_replay_mode_in_its_node(
    monkeypatch: pytest.MonkeyPatch,
    recorder: type[Recorder],
    overrides: list[str],
    enabled: bool,
    source: str,
) -> None:
    from skyrl_train.workers.megatron import worker as megatron_worker

    monkeypatch.setattr(megatron_worker, "MegatronPolicyWorker", recorder)
    cfg = load_config([*overrides, "trainer.policy.megatron_config.expert_model_parallel_size=2"])
    built = _build(cfg)
    architecture, node = built.args
    assert architecture is ARCHITECTURE
    assert node.moe_enable_routing_replay is enabled and node.routing_replay_source == source
    assert node.expert_model_parallel_size == 2  # the rest of the node as configured
    # A copy: the run's own node keeps its alias unset.
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is None
    assert built.kwargs["pad_token_id"] == 7 and built.kwargs["seed"] == cfg.trainer.seed
    assert built.kwargs["remove_microbatch_padding"] is True  # the default: packed


def test_strategy_builds_the_other_backend_on_the_same_config(
    monkeypatch: pytest.MonkeyPatch, recorder: type[Recorder]
) -> None:
    """The differential tests' way in: one config, each backend by name."""
    from skyrl_train.workers.fsdp import worker as fsdp_worker

    monkeypatch.setattr(fsdp_worker, "FSDPPolicyWorker", recorder)
    cfg = load_config([])  # trainer.strategy=megatron
    built = factory.build_worker(
        cfg, architecture=ARCHITECTURE, checkpoint="/models/tiny", pad_token_id=7, strategy="fsdp"
    )
    assert recorder.built == [built] and built.args[0] == "/models/tiny"
    with pytest.raises(ValueError, match=r"^checkpoint: expected the model folder .* got None"):
        factory.build_worker(cfg, architecture=ARCHITECTURE, pad_token_id=7, strategy="fsdp")
    with pytest.raises(ValueError, match=r"^trainer.strategy: expected one of megatron, fsdp"):
        factory.build_worker(cfg, architecture=ARCHITECTURE, pad_token_id=7, strategy="tpu")
    assert len(recorder.built) == 1


def test_the_trainer_passes_its_model_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from skyrl_train.trainer import policy as policy_module

    calls: list[dict[str, Any]] = []

    def build_worker(cfg: PPOConfig, **kwargs: Any) -> StandInWorker:
        calls.append(kwargs)
        return StandInWorker()

    class Info:
        architecture = ARCHITECTURE

    monkeypatch.setattr(factory, "build_worker", build_worker)
    monkeypatch.setattr(policy_module, "inspect_checkpoint", lambda folder: Info())
    monkeypatch.setattr(policy_module, "checkpoint_weights", lambda folder: iter(()))
    cfg = load_config(["trainer.strategy=fsdp", "trainer.ref.log_kl=false"])
    PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=5).setup()
    assert [c["checkpoint"] for c in calls] == [str(tmp_path)]
    assert calls[0]["architecture"] is ARCHITECTURE and calls[0]["pad_token_id"] == 5


def test_the_fsdp_branch_loads_no_megatron_module() -> None:
    # In a fresh process (this one has loaded Megatron for other tests): the factory
    # builds an FSDP worker (its class replaced, its module really imported) and no
    # Megatron module, ours or megatron-core's, is loaded.
    code = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests/skyrl_train/trainer')\n"
        "from _stand_in_worker import ARCHITECTURE, StandInWorker\n"
        "from skyrl_train.config import load_config\n"
        "from skyrl_train.workers import factory\n"
        "from skyrl_train.workers.fsdp import worker\n"
        "class Stub(StandInWorker):\n"
        "    def __init__(self, *a, **k): super().__init__()\n"
        "    def setup(self): return self\n"
        "worker.FSDPPolicyWorker = Stub\n"
        "factory.build_worker(load_config(['trainer.strategy=fsdp']), architecture=ARCHITECTURE,"
        " checkpoint='/models/tiny', pad_token_id=0)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'"
        " or '.workers.megatron' in m)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []
