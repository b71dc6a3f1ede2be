"""Prompt datasets: rows from parquet or JSON Lines files, checked before anything starts.

Row schema (SkyRL's): ``prompt`` (a non-empty list of ``{role, content}`` strings),
``env_class`` (a registered environment, or null for ``environment.env_class``), and
any other fields the environment reads: ``reward_spec`` (``{method, ground_truth}``),
``data_source`` (a string), ``extra_info`` (a mapping), ``max_turns``, ``db_id``...
A row becomes a ``skyrl_gym.Task`` whose environment is ``make(env_class,
env_config=environment.skyrl_gym.<env_class>, extras=<every field but prompt and
env_class>)``, as SkyRL's generator builds it; one environment per row is built while
loading, so a row its environment refuses fails now, naming the file and row.

Files are read with pyarrow: parquet is what SkyRL's dataset scripts write, pyarrow
reads it and JSON Lines without the ``datasets`` package's cache and network layer,
and it was already the engine under ``datasets``.

Sampling is a pure function of (seed, step): training walks the rows in epochs, each
epoch a fresh permutation from the seed, so a resumed run takes the same prompts.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import skyrl_gym
from skyrl_gym import Task
from skyrl_train.config.schema import DATA_SUFFIXES, PPOConfig
from skyrl_train.errors import DatasetError

__all__ = [
    "DATA_SUFFIXES",
    "PromptDatasets",
    "RowRef",
    "build_environment",
    "eval_tasks",
    "load_datasets",
    "load_tasks",
    "read_rows",
    "read_tasks",
    "sample_step",
]

_REQUIRED = ("prompt",)
_NOT_EXTRAS = ("prompt", "env_class")


def read_rows(path: str | Path, *, key: str) -> list[dict[str, Any]]:
    """Every row of a parquet or JSON Lines file as a dict (``key`` names the config
    entry in errors)."""
    file = Path(path)
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_table(file).to_pylist())
        import pyarrow.json as pj

        return list(pj.read_json(file).to_pylist())
    except Exception as exc:  # pyarrow raises several types; all mean "unreadable"
        if file.suffix == ".parquet":
            raise DatasetError(
                key,
                file,
                row=None,
                field=None,
                expected="a readable parquet file",
                got=str(exc),
            ) from exc
    # pyarrow infers one schema per file and names no line when a row breaks it (a
    # prompt that is a string in one row and a list in the others, a bad line): read
    # the lines one by one so the row checks below can name the culprit.
    return _json_lines(file, key)


def _json_lines(file: Path, key: str) -> list[dict[str, Any]]:
    import orjson

    rows: list[dict[str, Any]] = []
    with file.open("rb") as fh:
        for number, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(
                    key,
                    file,
                    row=number,
                    field=None,
                    expected="a JSON object",
                    got=f"invalid JSON ({exc})",
                ) from exc
            if not isinstance(value, dict):
                raise DatasetError(
                    key, file, row=number, field=None,
                    expected="a JSON object", got=type(value).__name__,
                )  # fmt: skip
            rows.append(value)
    return rows


def _check_row(
    row: Mapping[str, Any], *, key: str, path: str, number: int, default_env: str
) -> Task:
    fail = functools.partial(DatasetError, key, path, row=number)  # names this row
    for name in _REQUIRED:
        if row.get(name) is None:
            raise fail(field=name, expected="a value", got="none")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise fail(field="prompt", expected="a non-empty list of messages", got=f"{prompt!r:.80}")
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise fail(
                field=f"prompt[{i}]", expected="a {role, content} mapping", got=f"{message!r:.80}"
            )
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                raise fail(
                    field=f"prompt[{i}].{part}",
                    expected="a string",
                    got=f"{message.get(part)!r:.80}",
                )
    env_class = row.get("env_class") or default_env
    if not isinstance(env_class, str) or env_class not in skyrl_gym.registered():
        raise fail(
            field="env_class",
            expected=f"a registered environment {skyrl_gym.registered()}",
            got=repr(env_class),
        )
    spec = row.get("reward_spec")
    if spec is not None:  # optional: SkyRL's aime rows carry reward_model instead
        if not isinstance(spec, Mapping):
            raise fail(
                field="reward_spec",
                expected="a {method, ground_truth} mapping",
                got=f"{spec!r:.80}",
            )
        if not isinstance(spec.get("method"), str):
            raise fail(
                field="reward_spec.method", expected="a string", got=f"{spec.get('method')!r:.80}"
            )
        if spec.get("ground_truth") is None:
            raise fail(field="reward_spec.ground_truth", expected="a value", got="none")
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise fail(field="data_source", expected="a string", got=f"{source!r:.80}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise fail(field="extra_info", expected="a mapping", got=f"{extra!r:.80}")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    extras = {name: value for name, value in row.items() if name not in _NOT_EXTRAS}
    return Task(
        prompt=messages,
        env_name=env_class,
        env_extras=extras,
        data_source=source or env_class,
    )


@dataclass(frozen=True)
class RowRef:
    """Where a task came from: the config entry (``data.val_data[0]``), its file and
    0-based row; a generated prompt has no file (``file`` None, ``row`` its index)."""

    key: str
    file: str | None
    row: int

    def __str__(self) -> str:
        if self.file is None:
            return f"generated prompt {self.row} ({self.key} is empty)"
        return f"{self.key}: {self.file} row {self.row}"


def read_tasks(
    paths: Sequence[str], *, key: str, default_env_class: str
) -> Iterator[tuple[RowRef, Task]]:
    """Every row of ``paths`` as a ``Task`` with where it came from, in file order;
    raises ``DatasetError`` naming ``key[i]``, the file, the row (0-based) and the field
    of the first row that breaks the schema (when the iteration reaches it). No
    environment is built."""
    for i, path in enumerate(paths):
        file_key = f"{key}[{i}]"
        rows = read_rows(path, key=file_key)
        if not rows:
            raise DatasetError(file_key, path, row=None, field=None, expected="rows", got="none")
        for number, row in enumerate(rows):
            task = _check_row(
                row, key=file_key, path=path, number=number, default_env=default_env_class
            )
            yield RowRef(file_key, path, number), task


def build_environment(
    ref: RowRef, task: Task, env_configs: Mapping[str, Any], *, max_turns: int | None
) -> None:
    """Build (and close) ``task``'s environment once as the generator will; raises
    ``DatasetError`` naming the row when its environment refuses it."""
    try:
        env = skyrl_gym.make_task_env(
            task.env_name, task.env_extras, env_configs=env_configs, max_turns=max_turns
        )
        env.close()
    except (skyrl_gym.EnvError, TypeError, ValueError, LookupError, OSError) as exc:
        raise DatasetError(
            ref.key,
            ref.file or "<generated>",
            row=ref.row,
            field="env_class",
            expected=f"a row {task.env_name!r} accepts",
            got=str(exc),
        ) from exc


def load_tasks(
    paths: Sequence[str],
    *,
    key: str,
    default_env_class: str,
    env_configs: Mapping[str, Any],
    max_turns: int | None = None,
) -> list[Task]:
    """Every row of ``paths`` as a ``Task``, in file order; raises ``DatasetError``
    naming ``key[i]``, the file, the row (0-based) and the field of the first bad row.

    Each row's environment is built once (and closed) with its ``env_configs`` node,
    so a ground truth or setting it refuses is reported here, not mid-run.
    """
    tasks = []
    for ref, task in read_tasks(paths, key=key, default_env_class=default_env_class):
        build_environment(ref, task, env_configs, max_turns=max_turns)
        tasks.append(task)
    return tasks


def sample_step(
    tasks: Sequence[Task], *, batch_size: int, seed: int, step: int, round: int = 0
) -> list[Task]:
    """The prompts of training step ``step`` (1-based): rows ``[(step-1)*B, step*B)`` of
    an endless sequence of epochs, each epoch a permutation drawn from ``(seed, epoch)``.

    Every row is seen once per epoch; a batch that crosses an epoch boundary takes the
    end of one permutation and the start of the next. ``round`` > 0 (the extra
    generation rounds of dynamic sampling) reads its own sequence of permutations, so a
    step's extra prompts are as reproducible as its first ones.
    """
    if not tasks:
        raise ValueError("tasks: expected at least one row, got none")
    if step < 1 or batch_size < 1:
        raise ValueError(f"step, batch_size: expected >= 1, got {step}, {batch_size}")
    size = len(tasks)
    picked: list[Task] = []
    orders: dict[int, list[int]] = {}
    for index in range((step - 1) * batch_size, step * batch_size):
        epoch, position = divmod(index, size)
        if epoch not in orders:
            order = list(range(size))
            stream = f"{seed}:epoch:{epoch}" if round == 0 else f"{seed}:round:{round}:{epoch}"
            random.Random(stream).shuffle(order)
            orders[epoch] = order
        picked.append(tasks[orders[epoch][position]])
    return picked


GENERATED_DATASET_SIZE = 4096
"""Rows of the generated dataset used when ``data.train_data`` is empty."""
EVAL_SEED_OFFSET = 1_000_003
"""Generated held-out prompts come from a dataset seed training never draws from."""


@dataclass(frozen=True)
class PromptDatasets:
    train: list[Task]
    eval: list[Task]


def load_datasets(cfg: PPOConfig) -> PromptDatasets:
    """``data.train_data``/``data.val_data`` loaded and checked, or the environment's
    generated datasets when they are empty."""
    env = cfg.environment
    seed = cfg.trainer.seed

    def load(paths: list[str], key: str) -> list[Task]:
        return load_tasks(
            paths,
            key=key,
            default_env_class=env.env_class,
            env_configs=env.skyrl_gym,
            max_turns=cfg.generator.max_turns,
        )

    if cfg.data.train_data:
        train = load(cfg.data.train_data, "data.train_data")
    else:
        train = skyrl_gym.make_dataset(env.env_class, num_prompts=GENERATED_DATASET_SIZE, seed=seed)
    if cfg.data.val_data:
        held_out = load(cfg.data.val_data, "data.val_data")
    else:
        held_out = skyrl_gym.make_dataset(
            env.env_class,
            num_prompts=cfg.trainer.eval_batch_size,
            seed=seed + EVAL_SEED_OFFSET,
        )
    return PromptDatasets(train=train, eval=held_out)


def eval_tasks(cfg: PPOConfig) -> list[tuple[RowRef, Task]]:
    """The evaluation rows with where each came from: every row of ``data.val_data``
    (schema-checked; environments not built), or, when it is empty, the same
    ``trainer.eval_batch_size`` generated prompts the in-run evaluation uses."""
    env = cfg.environment
    if cfg.data.val_data:
        return list(
            read_tasks(cfg.data.val_data, key="data.val_data", default_env_class=env.env_class)
        )
    generated = skyrl_gym.make_dataset(
        env.env_class,
        num_prompts=cfg.trainer.eval_batch_size,
        seed=cfg.trainer.seed + EVAL_SEED_OFFSET,
    )
    return [(RowRef("data.val_data", None, i), task) for i, task in enumerate(generated)]
