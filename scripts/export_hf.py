"""Write a trainer checkpoint as a Hugging Face model folder.

    python scripts/export_hf.py --checkpoint runs/r3_grpo/checkpoints/step_000010 \\
        --out exports/step_10 [--model FOLDER] [--max-shard-bytes N] [--ray-address ADDR]

The output is what a run's own exports are (``trainer.hf_save_interval``,
``skyrl_train/runs/export.py``): ``config.json`` and tokenizer files of the model the
run trained, ``model.safetensors`` (sharded past ``--max-shard-bytes``) in the layout
``save_pretrained`` writes, ``generation_config.json`` with the EOS ids. It loads with
``transformers.AutoModelForCausalLM.from_pretrained``, ``python -m inference.server
--checkpoint`` and as a run's ``model.path``. It is written beside ``--out`` and renamed
into place; ``--out`` must be new, empty, or an earlier export (which it replaces).

How: the checkpoint is verified against its manifest (a damaged one is refused naming
the file), then the trainer ranks are started on a local Ray exactly as the run had them
(its ``run_config.json``: world size, pipeline, virtual-pipeline, expert and tensor
layout, replay mode, the model folder), each loads its own rank file, and the weights
stream out as in a weight sync: every pipeline stage, expert and tensor shard gathered,
rank 0 writing. A local Ray is one node, so the ranks are placed there with ``PACK``
whatever the run's ``trainer.placement.strategy`` (the two-node recipe's
``STRICT_SPREAD`` included); on ``--ray-address``'s cluster the run's strategy is kept,
and a placement the cluster does not make within the run's
``trainer.placement.timeout_s`` is refused naming the key. ``--model`` names
the model folder when the run's (``model.path``) has moved; the built-in model's is
rebuilt from its config if the cache was cleared.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.errors import CheckpointFormatError  # noqa: E402
from skyrl_train.errors import CheckpointError, ConfigValidationError, SkyRLTrainError  # noqa: E402
from skyrl_train.runs.checkpoint import (  # noqa: E402
    RUN_CONFIG_FILE,
    Checkpoint,
    verify_checkpoint,
)
from skyrl_train.runs.export import DEFAULT_MAX_SHARD_BYTES, check_target  # noqa: E402

KEY = "--checkpoint"
LOCAL_STRATEGY = "PACK"
"""The placement strategy of a run's ranks rebuilt on a local Ray (one node)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything checked before Ray starts."""

    checkpoint: Checkpoint
    cfg: Any
    """The run's ``PPOConfig``, set up to rebuild its policy ranks only."""
    model: Path
    pad_token_id: int
    out: Path
    notes: tuple[str, ...] = ()
    """What the export did differently from the run, printed when it starts."""


def prepare(checkpoint: Path, out: Path, *, model: Path | None, ray_address: str | None) -> Plan:
    """Verify the checkpoint, read its run config, check ``out`` and find the model
    folder; raises a ``SkyRLTrainError`` naming the argument and file at fault."""
    from skyrl_train.config.compose import parse_config
    from skyrl_train.config.model_source import inspect_folder, model_checkpoint

    found = verify_checkpoint(checkpoint, key=KEY)
    record_path = found.folder / RUN_CONFIG_FILE
    if not record_path.is_file():
        raise CheckpointError(
            KEY,
            record_path,
            expected=f"the {RUN_CONFIG_FILE} every save records the trainer layout and model in",
            got="no such file (a checkpoint saved before exports existed)",
        )
    try:
        raw = json.loads(record_path.read_bytes())
        cfg = parse_config(raw)
    except (ValueError, ConfigValidationError) as exc:
        raise CheckpointError(
            KEY, record_path, expected="the run's config sections", got=str(exc)
        ) from exc
    notes: list[str] = []
    if not _records_replay(raw):
        # A record of the releases that dropped the replay mode: read back as on, the
        # ranks refused a replay-off run's settings that are refused only under
        # replay. The export runs no forward, so replay changes nothing it writes,
        # and off builds whatever either mode trained with.
        cfg.trainer.policy.routing_replay.enabled = False
        notes.append(
            f"{record_path} records no trainer.policy.routing_replay: building the "
            "ranks with replay off (an export runs no forward; the weights are the same)"
        )
    placement = cfg.trainer.placement
    if placement.num_trainers != found.world_size:
        raise CheckpointError(
            KEY,
            record_path,
            expected=f"trainer.placement.num_trainers {found.world_size} (driver.json)",
            got=str(placement.num_trainers),
        )
    check_target(out, key="--out")
    folder = model if model is not None else model_checkpoint(cfg.model)
    try:
        info = inspect_folder(folder)
    except CheckpointFormatError as exc:
        hint = "" if model is not None else " (the run's model folder; pass --model if it moved)"
        raise ConfigValidationError("--model", f"{folder}{hint}: {exc}") from exc
    trainer = dataclasses.replace(
        cfg.trainer,
        # No reference copy of the weights: nothing here computes a KL.
        ref=dataclasses.replace(cfg.trainer.ref, log_kl=False),
        algorithm=dataclasses.replace(cfg.trainer.algorithm, use_kl_loss=False),
    )
    if ray_address is None and placement.strategy is not None:
        # A local Ray is one node: the two-node recipe's STRICT_SPREAD could never be
        # placed there and Ray would queue it forever; every strategy packs on one node.
        notes.append(
            f"trainer.placement.strategy {placement.strategy} placed as {LOCAL_STRATEGY} "
            "on a local Ray (one node)"
        )
        placement = dataclasses.replace(placement, strategy=LOCAL_STRATEGY)
        trainer = dataclasses.replace(trainer, placement=placement)
    cpus = max(1, math.ceil(placement.num_trainers * placement.cpus_per_trainer))
    ray = dataclasses.replace(cfg.ray, address=ray_address, num_cpus=cpus)
    cfg = dataclasses.replace(cfg, trainer=trainer, ray=ray)
    return Plan(found, cfg, Path(folder), info.pad_token_id, out, tuple(notes))


def _records_replay(raw: Any) -> bool:
    """Whether a run config names its replay mode: the ``routing_replay`` node, or
    the deprecated Megatron alias that records of older releases carried set."""
    trainer = raw.get("trainer") if isinstance(raw, dict) else None
    policy = trainer.get("policy") if isinstance(trainer, dict) else None
    if not isinstance(policy, dict):
        return False
    megatron = policy.get("megatron_config")
    alias = megatron.get("moe_enable_routing_replay") if isinstance(megatron, dict) else None
    return "routing_replay" in policy or alias is not None


def export(plan: Plan, *, max_shard_bytes: int) -> Path:
    """Start the checkpoint's trainer ranks, load it and write the export."""
    from skyrl_train.trainer.policy_group import PolicyGroup
    from skyrl_train.utils.ray_session import require_cpus, start_ray

    cfg, found = plan.cfg, plan.checkpoint
    placement, mc = cfg.trainer.placement, cfg.trainer.policy.megatron_config
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", flush=True)

    say(f"verified {found.folder} (step {found.step}, {len(found.files)} files)")
    for note in plan.notes:
        say(f"note: {note}")
    session = start_ray(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, runtime_env={})
    group = None
    try:
        require_cpus(
            {
                "trainer.placement.cpus_per_trainer": (
                    placement.num_trainers,
                    placement.cpus_per_trainer,
                )
            },
            local=cfg.ray.address is None,
        )
        say(
            f"starting {placement.num_trainers} trainer rank(s): pipeline "
            f"{mc.pipeline_model_parallel_size} (virtual {mc.virtual_pipeline_model_parallel_size}), "
            f"experts {mc.expert_model_parallel_size}, tensor {mc.tensor_model_parallel_size}; "
            f"placement {placement.strategy}; model {plan.model}"
        )
        group = PolicyGroup.place(cfg, checkpoint=str(plan.model), pad_token_id=plan.pad_token_id)
        group.setup()
        asyncio.run(group.load_checkpoint(str(found.folder)))
        say(f"loaded every rank's file of step {found.step}")
        folder, written = asyncio.run(
            group.export_hf(plan.out, step=found.step, key="--out", max_shard_bytes=max_shard_bytes)
        )
        say(
            f"wrote {folder}: {written.tensors} tensors, {written.total_bytes / 2**20:.1f} MiB "
            f"in {', '.join(written.files)}"
        )
    finally:
        if group is not None:
            group.kill()
        session.shutdown()
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/export_hf.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="a committed step_NNNNNN folder"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="new or empty folder, or an earlier export"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="the model folder the run trained, if it moved"
    )
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help=f"largest model-*.safetensors shard (default {DEFAULT_MAX_SHARD_BYTES})",
    )
    parser.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: a local Ray)"
    )
    args = parser.parse_args(argv)
    if args.max_shard_bytes < 1:
        parser.error(f"--max-shard-bytes: expected a positive int, got {args.max_shard_bytes}")
    try:
        plan = prepare(args.checkpoint, args.out, model=args.model, ray_address=args.ray_address)
        export(plan, max_shard_bytes=args.max_shard_bytes)
    except SkyRLTrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
