"""A synthetic run folder, shaped like a real run's: for the viewer's tests, its
benchmark (``scripts/bench_viewer.py``) and its screenshot, where no training is at hand.

Each trajectory alternates sampled replies (loss mask 1) and observations (0) over
``turns`` turns, with the log-probs, advantages, router flips and expert load a
multi-turn GRPO step on a small MoE would dump; everything comes from ``seed``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from skyrl_train.runs.rollouts import write_dump
from skyrl_train.viewer.inputs import METRICS_FILE, RUN_MARKER

LETTERS = "ABCDEFGH"


def trajectory(
    rng: random.Random, *, index: int, group: int, sample: int, turns: int, layers: int
) -> dict[str, Any]:
    letters = [rng.choice(LETTERS) for _ in range(turns)]
    tokens: list[str] = []
    mask: list[int] = []
    rollout: list[float] = []
    trainer: list[float] = []
    turn_list: list[dict[str, Any]] = []
    rewards = []
    for k, letter in enumerate(letters):
        start = len(tokens)
        right = rng.random() < 0.6
        reply = [letter if right else rng.choice(LETTERS), "\n"] + [rng.choice(" .")] * rng.randint(
            0, 3
        )
        for text in reply:
            lp = -abs(rng.gauss(0.0, 0.8 if right else 2.0))
            tokens.append(text)
            mask.append(1)
            rollout.append(round(lp, 5))
            # Mostly tiny gaps, now and then a large one (a flipped expert).
            gap = 10 ** rng.uniform(-4.5, -1.5 if rng.random() < 0.9 else 0.3)
            trainer.append(round(min(0.0, lp + rng.choice((1, -1)) * gap), 5))
        reward = 1.0 / turns if right else 0.0
        rewards.append(reward)
        turn_list.append(
            {"start": start, "end": len(tokens), "reward": reward, "policy_versions": [index % 3]}
        )
        if k + 1 < turns:
            for text in ("Now", ":", " ", letters[k + 1], "\n"):
                tokens.append(text)
                mask.append(0)
                rollout.append(0.0)
                trainer.append(0.0)
    token_rewards = [0.0] * len(tokens)
    for turn, reward in zip(turn_list, rewards, strict=True):
        token_rewards[turn["end"] - 1] = reward
    return {
        "index": index, "group": group, "sample": sample,
        "data_source": "synthetic", "env_class": "repeat_letter",
        "prompt_text": f"Repeat each letter you are shown, one per reply.\nLetter: {letters[0]}\n",
        "prompt_ids": [ord(c) for c in "Repeat"],
        "response_ids": [ord(t[0]) if t else 0 for t in tokens], "tokens": tokens,
        "loss_mask": mask, "rollout_logprobs": rollout, "trainer_logprobs": trainer,
        "advantages": None, "token_rewards": token_rewards,
        "reward": round(sum(rewards), 4), "stop_reason": "done", "solved": sum(rewards) > 0.99,
        "turns": turn_list,
        "router_flips": [[] for _ in tokens],
        "router_flips_native": [
            sorted(rng.sample(range(layers), rng.randint(1, 2))) if m and rng.random() < 0.15 else []
            for m in mask
        ],
    }  # fmt: skip


def step_document(
    step: int, *, kind: str = "train", groups: int = 2, group_size: int = 4, turns: int = 3,
    layers: int = 4, experts: int = 8, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """One step's dump; advantages are each turn's GRPO score (reward minus the group's
    mean over the group's std) on that turn's sampled tokens, 0 on observations."""
    rng = random.Random(f"{seed}/{kind}/{step}")
    trajectories = [
        trajectory(rng, index=g * group_size + s, group=g, sample=s, turns=turns, layers=layers)
        for g in range(groups)
        for s in range(group_size)
    ]
    for g in range(groups):
        members = trajectories[g * group_size : (g + 1) * group_size]
        rewards = [t["reward"] for t in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) or 1.0
        for t in members:
            advantage = round((t["reward"] - mean) / std, 5)
            t["advantages"] = [advantage if m else 0.0 for m in t["loss_mask"]]
    load = [[rng.randint(0, 400) for _ in range(experts)] for _ in range(layers)]
    return {
        "step": step, "kind": kind, "num_layers": layers, "num_experts": experts,
        "expert_load": load, "group_size": group_size, "trajectories": trajectories,
    }  # fmt: skip


def metrics_row(step: int, *, steps: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(f"{seed}/metrics/{step}")
    progress = step / max(steps, 1)
    row: dict[str, Any] = {
        "step": step,
        "reward/mean": round(0.1 + 0.8 * progress + rng.gauss(0, 0.05), 4),
        "reward/success_rate": round(min(1.0, max(0.0, 0.8 * progress + rng.gauss(0, 0.05))), 4),
        "policy/entropy": round(1.5 - progress + rng.gauss(0, 0.03), 4),
        "policy/kl_to_ref": round(0.02 * progress + abs(rng.gauss(0, 0.002)), 5),
        "r3/router_agreement_trained": 1.0,
        "r3/router_agreement_native": round(0.93 + rng.gauss(0, 0.01), 4),
        "mismatch_trained/mean_abs_logp_diff": round(abs(rng.gauss(0.01, 0.002)), 5),
        "mismatch_native/mean_abs_logp_diff": round(abs(rng.gauss(0.05, 0.01)), 5),
        "timing/step_s": round(20 + rng.gauss(0, 1), 3),
        "timing/generate_s": round(8 + rng.gauss(0, 0.5), 3),
        "timing/train_s": round(11 + rng.gauss(0, 0.5), 3),
    }
    if step % 10 == 0:
        row["eval/reward_mean"] = round(0.05 + 0.9 * progress, 4)
        row["eval/success_rate"] = round(0.8 * progress, 4)
    return row


def make_run(
    run_dir: str | Path, *, steps: int, dump_every: int = 1, eval_every: int = 10, seed: int = 0,
    **shape: Any,
) -> Path:  # fmt: skip
    """A run folder: ``run.json``, ``metrics.jsonl`` for steps 1..``steps``, a train
    dump every ``dump_every`` steps and an eval dump every ``eval_every``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).write_text(json.dumps({"format": "skyrl-r3-run", "synthetic": True}))
    with (run_dir / METRICS_FILE).open("w") as fh:
        for step in range(1, steps + 1):
            fh.write(json.dumps(metrics_row(step, steps=steps, seed=seed)) + "\n")
    for step in range(1, steps + 1):
        if step % dump_every == 0 or step == 1:
            write_dump(run_dir, step_document(step, seed=seed, **shape))
        if eval_every and step % eval_every == 0:
            write_dump(run_dir, step_document(step, kind="eval", seed=seed, **shape))
    return run_dir
