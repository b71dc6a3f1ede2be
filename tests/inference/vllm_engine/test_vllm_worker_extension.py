"""The worker extension inside vLLM's own environment: it registers its transport; its
MoE guard, on stand-in MoE layers, re-runs the experts' post-load step only when vLLM
skipped it (a vLLM without the bug must not get a second prepack); and its transport
engine reads a bucket only from the transport's folder or the sender's announced
origin, within the size cap, refusing anything else with the key named; and each
worker of a tensor-parallel server announces itself to the trainer's real sender and
pulls every bucket."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.vllm.process import stage_worker_modules
from inference.vllm.senders import URLBucketSender

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


SOURCES = """
import http.server, json, os, tempfile, threading, types
from pathlib import Path
import torch
from safetensors.torch import save
from inference.vllm import transport, worker_extension as we

class Model(torch.nn.Module):  # records what a bucket would load
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8))
        self.loaded = []
    def load_weights(self, weights):
        self.loaded.append(sorted(name for name, _ in weights))

config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=2),
                               model_config=None)
engine = we.FileWeightTransferEngine(None, config, torch.device("cpu"), Model())
body = save({"w": torch.ones(8)})
big = save({"w": torch.ones(64)})

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        data = big if self.path == "/big" else body
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
origin = f"http://127.0.0.1:{server.server_address[1]}"
other = f"http://127.0.0.1:{server.server_address[1] + 1}"

inside = Path(tempfile.mkdtemp(dir=transport.prepare_bucket_dir()))
(inside / "good.safetensors").write_bytes(body)
(inside / "big.safetensors").write_bytes(big)
outside = Path(tempfile.mkdtemp()) / "secret.safetensors"
outside.write_bytes(body)
(inside / "escape.safetensors").symlink_to(outside)

def attempt(update):
    try:
        engine.receive_weights(engine.parse_update_info(update))
        return engine.model.loaded[-1]
    except ValueError as exc:
        return str(exc)

result = {"cap": engine.max_bucket_bytes, "origin": origin}
result["url_before_init"] = attempt({"url": origin + "/b"})
engine.init_transfer_engine(engine.parse_init_info(transport.url_init_info(origin)))
result.update({
    "file": attempt({"path": str(inside / "good.safetensors")}),
    "outside": attempt({"path": str(outside)}),
    "traversal": attempt({"path": f"{inside}/../../{outside.relative_to('/')}"}),
    "symlink": attempt({"path": str(inside / "escape.safetensors")}),
    "url": attempt({"url": origin + "/b", "api_key": "k"}),
    "other_host": attempt({"url": origin.replace("127.0.0.1", "127.0.0.2") + "/b"}),
    "other_port": attempt({"url": other + "/b"}),
})
engine.max_bucket_bytes = len(body)  # a cap between the two buckets' sizes
result["big_file"] = attempt({"path": str(inside / "big.safetensors")})
result["big_url"] = attempt({"url": origin + "/big"})
result["sizes"] = [len(body), len(big)]
print(json.dumps(result), flush=True)

# Two workers of one tensor-parallel server against the test's real URLBucketSender:
# each announces itself at the handshake, then each pulls the bucket.
import sys
workers = [we.FileWeightTransferEngine(None, config, torch.device("cpu"), Model())
           for _ in range(2)]
init = json.loads(sys.stdin.readline())
for worker in workers:
    worker.init_transfer_engine(worker.parse_init_info(init))
print(json.dumps([worker.worker_id for worker in workers]), flush=True)
update = json.loads(sys.stdin.readline())
pulled = {}
for i, worker in enumerate(workers):
    worker.receive_weights(worker.parse_update_info(update))
    pulled[f"worker {i}"] = worker.model.loaded[-1]
try:
    workers[0].receive_weights(workers[0].parse_update_info(update))
    pulled["third"] = "served"
except ValueError as exc:
    pulled["third"] = str(exc)
print(json.dumps(pulled), flush=True)
"""


def test_buckets_are_read_only_from_the_transport_folder_and_the_senders_origin(
    vllm_python, tmp_path: Path
) -> None:
    staged = stage_worker_modules(tmp_path / "pythonpath")
    env = {**os.environ, "PYTHONPATH": str(staged)}
    stderr = tmp_path / "stderr.txt"
    seen: dict[str, Any] = {}

    async def main() -> None:
        with stderr.open("wb") as errors:
            proc = await asyncio.create_subprocess_exec(
                vllm_python,
                "-c",
                SOURCES,
                env=env,
                cwd=staged,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=errors,
            )
        assert proc.stdin is not None and proc.stdout is not None
        stdin, stdout = proc.stdin, proc.stdout

        async def exchange(message: Any) -> Any:
            if message is not None:
                stdin.write(json.dumps(message).encode() + b"\n")
                await stdin.drain()
            line = await asyncio.wait_for(stdout.readline(), timeout=300)
            assert line, stderr.read_text()[-3000:]
            return json.loads(line)

        sender = URLBucketSender("127.0.0.1")

        async def post_init(info: dict[str, str]) -> None:
            seen["announced"] = await exchange(info)

        async def post_update(info: dict[str, str]) -> None:
            seen["pulled"] = await exchange(info)

        try:
            seen["sources"] = await exchange(None)
            await sender.connect(post_init)
            seen["workers"] = sender.workers
            await sender.send({"w": torch.ones(8)}, post_update)
            assert await asyncio.wait_for(proc.wait(), timeout=60) == 0, stderr.read_text()
        finally:
            await sender.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(main())
    result = seen["sources"]
    # Every parameter as F32 over both workers, plus the header allowance.
    assert result["cap"] == 4 * 8 * 2 + (64 << 20)
    assert result["file"] == ["w"] and result["url"] == ["w"]  # the good cases still load
    assert result["url_before_init"].startswith(
        "update_info.url: expected a URL at the origin the trainer named"
    )
    for case in ("outside", "traversal", "symlink"):
        assert result[case].startswith("update_info.path: expected a file inside "), result[case]
        assert "(the skyrl_file transport's folder)" in result[case]
    for case in ("other_host", "other_port"):
        assert result[case].startswith(
            f"update_info.url: expected a URL at {result['origin']} (init_info.bucket_origin)"
        ), result[case]
    small, big = result["sizes"]
    for case, key in (("big_file", "path"), ("big_url", "url")):
        assert result[case].startswith(
            f"update_info.{key}: expected a bucket of at most {small} bytes"
        ) and result[case].endswith(f"got {big} bytes"), result[case]
    # A tensor-parallel server's two workers: both announced, both pulled, no one more.
    assert len(set(seen["announced"])) == 2 and seen["workers"] == 2
    assert seen["pulled"] == {
        "worker 0": ["w"],
        "worker 1": ["w"],
        "third": "update_info.url: expected a 200 reply, got HTTP 404",
    }
