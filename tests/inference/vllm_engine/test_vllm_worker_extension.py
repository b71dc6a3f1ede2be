"""The worker extension inside vLLM's own environment, on stand-in MoE layers: it
registers its transport, and its MoE guard re-runs the experts' post-load step only
when vLLM skipped it (a vLLM without the bug must not get a second prepack)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from inference.vllm.process import stage_worker_modules

pytestmark = pytest.mark.slow

SCRIPT = """
import importlib, json
import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
from inference.vllm import transport, worker_extension as we

registered = WeightTransferEngineFactory._registry[transport.BACKEND]()
importlib.reload(we)  # a second import must not fail on the registration

class Experts:  # experts with a post-load step of their own (CPU: the prepack)
    def __init__(self):
        self.calls = 0
    def process_weights_after_loading(self, layer):
        self.calls += 1

class NoStep:  # experts that keep the base class's no-op step
    process_weights_after_loading = FusedMoEExperts.process_weights_after_loading

class Kernel:
    def __init__(self, experts):
        self.fused_experts = experts

class Method:
    def __init__(self, experts, runs_step):
        self.moe_kernel, self.runs_step = Kernel(experts), runs_step
    def process_weights_after_loading(self, layer):
        if self.runs_step:  # a vLLM without the bug
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

class Layer(torch.nn.Module):
    def __init__(self, method):
        super().__init__()
        self.quant_method = method

def reload(fix_enabled):
    layers = [Layer(Method(Experts(), True)), Layer(Method(Experts(), False)),
              Layer(Method(NoStep(), False))]
    model = torch.nn.Sequential(*layers)
    report = we.MoEReloadReport(fix_enabled=fix_enabled)
    we.guard_moe_reload(model, report)
    we.guard_moe_reload(model, report)  # idempotent: no double wrapping
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
    return {"report": vars(report), "calls": [l.quant_method.moe_kernel.fused_experts.calls
                                              for l in layers[:2]]}

print(json.dumps({"registered": registered.__name__, "fixed": reload(True),
                  "disabled": reload(False)}))
"""


def test_moe_guard_reruns_the_step_only_where_vllm_skipped_it(vllm_python, tmp_path: Path) -> None:
    staged = stage_worker_modules(tmp_path / "pythonpath")
    env = {**os.environ, "PYTHONPATH": str(staged)}
    done = subprocess.run(
        [vllm_python, "-c", SCRIPT],
        env=env,
        cwd=staged,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["registered"] == "FileWeightTransferEngine"
    # Layer 0: vLLM ran the step (no rerun); layer 1: vLLM skipped it (rerun once);
    # layer 2: its experts have no step of their own (not guarded).
    assert result["fixed"] == {
        "report": {"moe_layers": 2, "skipped_postprocess": 1, "reruns": 1, "fix_enabled": True},
        "calls": [1, 1],
    }
    assert result["disabled"] == {
        "report": {"moe_layers": 2, "skipped_postprocess": 1, "reruns": 0, "fix_enabled": False},
        "calls": [1, 0],
    }
