"""Rollout dumps: a bounded sample of each step's trajectories, kept in the run folder.

``<run_dir>/rollouts/step_NNNNNN.json.gz`` holds a training step's sample and
``eval_NNNNNN.json.gz`` the evaluation run after step N (``logging.dump_rollouts``
trajectories each). One gzip-compressed JSON document per file, written beside its
final name and renamed over it, so a reader sees a whole file or none. A run resumed
from step k drops the dumps of later steps first, as ``metrics.jsonl`` drops its
lines, so the folder holds one history (``drop_dumps_after``).

The document (``FORMAT``, ``VERSION``)::

    {"format": "skyrl-r3/rollouts", "version": 1, "step": 3, "kind": "train",
     "num_layers": 4, "num_experts": 8,             # MoE layers / experts, or null
     "expert_load": [[...E counts] * L] | null,     # tokens routed to each expert (the
                                                    # engine's routes, the whole step)
     "group_size": 8,
     "trajectories": [{
        "index": 0, "group": 0, "sample": 0,        # row in the step, prompt, sample
        "data_source": "...", "env_class": "...",
        "prompt_text": "..." | null, "prompt_ids": [...],   # text: null without a tokenizer
        "response_ids": [...], "tokens": ["a", ...] | null,  # each response token's text
        "loss_mask": [1, 0, ...],                       # 1: sampled by the policy
        "rollout_logprobs": [...] | null,               # the engine's, 0.0 off-policy tokens
        "trainer_logprobs": [...] | null,               # the trainer's, before the update
        "advantages": [...] | null,
        "token_rewards": [...],
        "reward": 1.0, "stop_reason": "done", "solved": true | null,
        "turns": [{"start": 0, "end": 1, "reward": 0.33, "policy_versions": [2]}],
        "router_flips": [[...layers], ...] | null,        # per response token: MoE layers
        "router_flips_native": [[...layers], ...] | null  # whose top-k differed from the
     }]}                                                  # engine's (trained / own routing)

A ``turns`` entry is one reply: response positions ``[start, end)`` sampled by the
policy, the reward the environment gave it, and the policy versions its tokens came
from. ``router_flips``: the routing the trainer trained with (replay on: the
engine's, so every list is empty); ``_native``: the trainer's own router's choice.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from skyrl_train.errors import RolloutDumpError
from skyrl_train.utils.durable import replace_file

__all__ = [
    "FORMAT",
    "KINDS",
    "ROLLOUTS_DIR",
    "VERSION",
    "DumpRef",
    "RolloutDumpError",
    "drop_dumps_after",
    "dump_path",
    "list_dumps",
    "read_dump",
    "write_dump",
]

ROLLOUTS_DIR = "rollouts"
FORMAT = "skyrl-r3/rollouts"
VERSION = 1
KINDS = ("train", "eval")
_NAME = re.compile(r"^(step|eval)_(\d{6,})\.json\.gz$")
_PREFIX = {"train": "step", "eval": "eval"}


@dataclass(frozen=True)
class DumpRef:
    step: int
    kind: str
    path: Path


def dump_path(run_dir: str | Path, step: int, kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    return Path(run_dir) / ROLLOUTS_DIR / f"{_PREFIX[kind]}_{step:06d}.json.gz"


def write_dump(run_dir: str | Path, document: dict[str, Any]) -> Path:
    """Write one step's dump atomically; returns its path. ``document`` holds ``step``,
    ``kind`` and ``trajectories`` (the format and version are set here)."""
    path = dump_path(run_dir, int(document["step"]), str(document["kind"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    body = orjson.dumps({"format": FORMAT, "version": VERSION, **document})
    # mtime=0: the same dump gives the same bytes (a resumed step rewrites identically).
    replace_file(path, gzip.compress(body, compresslevel=6, mtime=0))
    return path


def read_dump(path: str | Path) -> dict[str, Any]:
    """One dump, checked: a torn file, another format or a newer version raises
    ``RolloutDumpError`` naming the file."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes())
    except FileNotFoundError:
        raise RolloutDumpError(path, "expected a rollout dump, got no such file") from None
    except (OSError, EOFError) as exc:  # gzip's torn or not-gzip errors
        raise RolloutDumpError(path, f"expected a whole gzip file, got a torn one ({exc})") from exc
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RolloutDumpError(path, f"expected JSON, got {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        got = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise RolloutDumpError(path, f"expected format {FORMAT!r}, got {got!r}")
    version = document.get("version")
    if version != VERSION:
        raise RolloutDumpError(
            path,
            f"expected version {VERSION}, got {version!r}: "
            + (
                "written by a newer skyrl-r3"
                if isinstance(version, int) and version > VERSION
                else "an older format this version no longer reads"
            ),
        )
    if not isinstance(document.get("trajectories"), list):
        raise RolloutDumpError(path, "expected a 'trajectories' list")
    return document


def list_dumps(run_dir: str | Path) -> list[DumpRef]:
    """Every dump of ``run_dir``, by step then kind (train before the eval after it);
    names that are not dumps (a ``.tmp-`` file of a killed write) are skipped."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match:
            kind = "train" if match.group(1) == "step" else "eval"
            found.append(DumpRef(int(match.group(2)), kind, path))
    return sorted(found, key=lambda ref: (ref.step, KINDS.index(ref.kind)))


def drop_dumps_after(run_dir: str | Path, step: int) -> int:
    """Delete the dumps of steps after ``step`` (and torn writes); returns how many."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    dropped = 0
    if folder.is_dir():
        for path in folder.iterdir():
            if ".tmp-" in path.name:
                path.unlink(missing_ok=True)
                dropped += 1
    for ref in list_dumps(run_dir):
        if ref.step > step:
            ref.path.unlink(missing_ok=True)
            dropped += 1
    return dropped
