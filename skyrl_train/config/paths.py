"""Every path key of a launch made absolute once, before any actor or server sees it.

A relative path means "relative to the folder the user launched from", but the
processes that read it run elsewhere: Ray actors in their own working directories, on
other nodes, and each vLLM server in a private staging folder
(``inference.vllm.process``). The docs' ``model.path=ckpt/qwen3_moe_vllm`` was found by
validation, then not by the vLLM server, which went to the Hugging Face hub for it
(docs/vllm.md). So the launch resolves every key below against the user's folder (for
a Hydra command, the folder it started in, whatever ``hydra.job.chdir`` does) and hands
the result to everything after it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from skyrl_train.config.schema import PPOConfig
from skyrl_train.runs.folder import LATEST

PATH_KEYS = (
    "model.path",
    "model.cache_dir",
    "data.train_data",
    "data.val_data",
    "generator.inference_engine.vllm.python",
    "trainer.export_path",
    "trainer.resume_from",
    "trainer.run_dir",
)
"""The config keys that name a file or folder (a list key: each of its entries)."""


def _absolute(value: str, base: Path) -> str:
    path = Path(os.path.expanduser(value))
    return os.path.normpath(path if path.is_absolute() else base / path)


def _replace(node: object, key: str, value: object) -> object:
    head, _, rest = key.partition(".")
    child = getattr(node, head)
    new = value if not rest else _replace(child, rest, value)
    return dataclasses.replace(node, **{head: new})  # type: ignore[type-var]


def resolve_paths(cfg: PPOConfig, *, base: str | Path | None = None) -> PPOConfig:
    """``cfg`` with every ``PATH_KEYS`` value absolute: relative ones joined to ``base``
    (default: the working directory), ``~`` expanded; unset keys and
    ``trainer.resume_from=latest`` stay as they are. Idempotent."""
    root = Path(base if base is not None else os.getcwd()).resolve()
    for key in PATH_KEYS:
        node: object = cfg
        for part in key.split("."):
            node = getattr(node, part)
        value: object = node
        if isinstance(value, list):
            value = [_absolute(v, root) for v in value]
        elif isinstance(value, str) and not (key == "trainer.resume_from" and value == LATEST):
            value = _absolute(value, root)
        else:
            continue
        cfg = _replace(cfg, key, value)  # type: ignore[assignment]
    return cfg
