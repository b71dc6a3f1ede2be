"""The driver's side of the rollout dumps (``logging.dump_rollouts``): which
trajectories of a step are kept and what is recorded of each
(``skyrl_train/runs/rollouts.py`` holds the format and the files).

The first N trajectories of each training step (whole GRPO groups when N is a multiple
of the group size) and of each evaluation. For a training step the trainer looks at
those rows once more before its update (``PolicyGroup.inspect``): the logprobs its
old-logprob pass computes, replayed as the step trains, and where its routing, as
trained and its own, differed from the engine's, per token and MoE layer. That is two
forwards over N rows, a few percent of a step at the default 8 of 64.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.runs.rollouts import drop_dumps_after, write_dump

_DIGITS = 5
"""Logprobs, advantages and rewards are kept to this many decimals: the dumps are for
reading, and full floats would triple their size."""


class Inspection(NamedTuple):
    """``PolicyTrainer.inspect``'s answer for a few rows of a step."""

    logprobs: torch.Tensor
    """[B, R] the trainer's logprobs of the response tokens, before the update."""
    flips: torch.Tensor | None
    """[B, S, L] bool, batch layout: the trained routing differed from the engine's
    (None: the batch carries no engine routes)."""
    native_flips: torch.Tensor | None
    """The same for the trainer's own routing (no replay)."""


def _round(values: Sequence[float] | np.ndarray | torch.Tensor | None) -> list[float] | None:
    if values is None:
        return None
    array = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    return np.round(array.astype(np.float64), _DIGITS).tolist()


def _flip_lists(flips: torch.Tensor | None, row: int, start: int, count: int) -> list | None:
    """Per response token (columns ``start..start+count``), the layers that flipped."""
    if flips is None:
        return None
    block = flips[row, start : start + count].numpy()
    return [np.flatnonzero(token).tolist() for token in block]


def turns(
    loss_mask: Sequence[int],
    token_rewards: Sequence[float],
    versions: Sequence[Sequence[int] | None] | None,
) -> list[dict[str, Any]]:
    """One entry per reply: its run of sampled tokens ``[start, end)``, its reward (the
    turn's, on its last token) and the policy versions it came from."""
    spans, start = [], None
    for j, bit in enumerate([*loss_mask, 0]):
        if bit and start is None:
            start = j
        elif not bit and start is not None:
            spans.append((start, j))
            start = None
    out = []
    for k, (a, b) in enumerate(spans):
        version = versions[k] if versions is not None and k < len(versions) else None
        out.append(
            {
                "start": a,
                "end": b,
                "reward": round(float(sum(token_rewards[a:b])), _DIGITS),
                "policy_versions": None if version is None else list(version),
            }
        )
    return out


def expert_load(routes: Sequence[np.ndarray] | None, num_experts: int | None) -> list | None:
    """``[L][E]`` tokens routed to each expert over ``routes`` (the engine's)."""
    if not routes:
        return None
    stacked = np.concatenate([np.asarray(r).reshape(-1, *np.shape(r)[1:]) for r in routes])
    if stacked.ndim != 3 or stacked.shape[0] == 0:
        return None
    experts = max(int(stacked.max()) + 1, num_experts or 0)
    return [
        np.bincount(stacked[:, layer].reshape(-1), minlength=experts).tolist()
        for layer in range(stacked.shape[1])
    ]


class RolloutDumper:
    """Writes ``count`` trajectories of each step and each evaluation to ``run_dir``."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        count: int,
        tokenizer: Any,
        group_size: int,
        start_step: int,
        num_experts: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.count, self.tokenizer, self.group_size = count, tokenizer, group_size
        self.num_experts = num_experts
        # A resumed run owns every later step, as metrics.jsonl's lines.
        drop_dumps_after(self.run_dir, start_step)

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def rows(self, batch_size: int) -> list[int]:
        return list(range(min(self.count, batch_size)))

    def write_train(
        self,
        step: int,
        output: GeneratorOutput,
        *,
        advantages: torch.Tensor,
        inspection: Inspection | None,
        prompt_width: int,
        sources: Sequence[tuple[str, str]] | None,
    ) -> Path:
        """``prompt_width``: the batch's left-padded prompt columns (``S - R``), where
        response token 0's route row sits in the inspection's flips."""
        records = []
        for k, i in enumerate(self.rows(len(output.rewards))):
            count = len(output.response_ids[i])
            record = self._record(i, output, sources, self.group_size)
            record["advantages"] = _round(advantages[i, :count])
            if inspection is not None:
                record["trainer_logprobs"] = _round(inspection.logprobs[k, :count])
                record["router_flips"] = _flip_lists(inspection.flips, k, prompt_width, count)
                record["router_flips_native"] = _flip_lists(
                    inspection.native_flips, k, prompt_width, count
                )
            records.append(record)
        return self._write(step, "train", output, records, self.group_size)

    def write_eval(
        self,
        step: int,
        output: GeneratorOutput,
        *,
        group_size: int,
        sources: Sequence[tuple[str, str]] | None,
    ) -> Path:
        rows = self.rows(len(output.rewards))
        records = [self._record(i, output, sources, group_size) for i in rows]
        return self._write(step, "eval", output, records, group_size)

    def _write(
        self,
        step: int,
        kind: str,
        output: GeneratorOutput,
        records: list[dict[str, Any]],
        group_size: int | None = None,
    ) -> Path:
        routes = output.routed_experts
        first = routes[0] if routes else None
        return write_dump(
            self.run_dir,
            {
                "step": step,
                "kind": kind,
                "num_layers": None if first is None else int(np.shape(first)[1]),
                "num_experts": self.num_experts,
                "expert_load": expert_load(routes, self.num_experts),
                "group_size": group_size,
                "trajectories": records,
            },
        )

    def _decode(self, ids: list[int]) -> str | None:
        """The text of ``ids``; None without a tokenizer (a loop built without one)."""
        return None if self.tokenizer is None else str(self.tokenizer.decode(ids))

    def _record(
        self,
        i: int,
        output: GeneratorOutput,
        sources: Sequence[tuple[str, str]] | None,
        group_size: int,
    ) -> dict[str, Any]:
        response = list(output.response_ids[i])
        prompt = list(output.prompt_token_ids[i])
        source, env_class = sources[i] if sources is not None else (None, None)
        return {
            "index": i,
            "group": i // group_size,
            "sample": i % group_size,
            "data_source": source,
            "env_class": env_class,
            "prompt_ids": prompt,
            "prompt_text": self._decode(prompt),
            "response_ids": response,
            "tokens": [self._decode([token]) for token in response],
            "loss_mask": list(output.loss_masks[i]),
            "rollout_logprobs": _round(
                None if output.rollout_logprobs is None else output.rollout_logprobs[i]
            ),
            "trainer_logprobs": None,
            "advantages": None,
            "token_rewards": _round(output.token_rewards[i]),
            "reward": round(float(output.rewards[i]), _DIGITS),
            "stop_reason": output.stop_reasons[i],
            "solved": None if output.solved is None else output.solved[i],
            "turns": turns(
                output.loss_masks[i],
                output.token_rewards[i],
                None if output.turn_versions is None else output.turn_versions[i],
            ),
            "router_flips": None,
            "router_flips_native": None,
        }
