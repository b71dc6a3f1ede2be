"""The driver shards and combines batches without loading a trainer backend: the
Megatron worker's package runs import side effects (process-wide warning filters) and
megatron-core itself, the FSDP worker's builds on transformers' models, and the driver
process needs neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BACKEND_PACKAGES = ("skyrl_train.workers.megatron", "skyrl_train.workers.fsdp")
"""Each trainer backend's package (``trainer.strategy``): the factory imports one inside
the rank actor."""


def loaded_after(module: str) -> list[str]:
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('skyrl_train.workers', 'megatron')))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return list(json.loads(done.stdout))


def test_the_data_parallel_driver_does_not_import_the_worker() -> None:
    assert loaded_after("skyrl_train.trainer.data_parallel") == []


def test_the_batch_operations_do_not_import_the_worker() -> None:
    assert loaded_after("skyrl_train.dataset.batch") == []


def test_the_driver_loads_no_training_backend() -> None:
    """The launch's driver modules (the entry point, the policy group and through it the
    trainer-rank module, the loop and the engines) load no backend: the rank actor
    builds its worker through ``workers/factory.py``, imported inside ``setup``."""
    modules = (
        "skyrl_train.entrypoints.main_base",
        "skyrl_train.trainer.policy_group",
        "skyrl_train.trainer.loop",
        "skyrl_train.trainer.engines",
    )
    loaded = loaded_after(", ".join(modules))
    backends = [
        m for m in loaded if m.split(".")[0] == "megatron" or m.startswith(BACKEND_PACKAGES)
    ]
    assert backends == []
    # The worker contract is what the trainer module does load.
    assert "skyrl_train.workers.base" in loaded
