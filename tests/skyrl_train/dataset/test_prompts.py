"""Dataset files: rows checked before anything starts, sampled as a function of (seed, step)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_train.config.compose import load_config
from skyrl_train.dataset.prompts import load_datasets, load_tasks, read_rows, sample_step
from skyrl_train.errors import ConfigValidationError, DatasetError


class ExactAnswerEnv(BaseTextEnv):
    """One turn: reward 1 when the reply equals the row's ground truth."""

    name = "exact_answer_test"

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        spec = (extras or {}).get("reward_spec")
        if not isinstance(spec, Mapping):
            raise skyrl_gym.EnvError(f"{self.name}.extras.reward_spec: expected a mapping")
        self.truth = str(spec["ground_truth"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        reward = float(action.strip() == self.truth)
        return {"observations": [], "reward": reward, "done": True, "metadata": {}}


@pytest.fixture(autouse=True)
def exact_answer_env() -> Iterator[None]:
    skyrl_gym.register(ExactAnswerEnv.name, ExactAnswerEnv)
    yield
    skyrl_gym.deregister(ExactAnswerEnv.name)


def _row(i: int, **changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "env_class": ExactAnswerEnv.name,
        "reward_spec": {"method": "rule", "ground_truth": str(i + 1)},
        "data_source": "toy/" + ("even" if i % 2 == 0 else "odd"),
        "extra_info": {"index": i},
    }
    row.update(changes)
    return row


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(paths: list[Path], **kwargs: Any) -> list[skyrl_gym.Task]:
    return load_tasks(
        [str(p) for p in paths],
        key="data.train_data",
        default_env_class=kwargs.pop("default_env_class", ExactAnswerEnv.name),
        env_configs=kwargs.pop("env_configs", {}),
    )


def test_parquet_and_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    rows = [_row(i) for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "a.parquet")
    _jsonl(tmp_path / "b.jsonl", rows[3:])
    tasks = _load([tmp_path / "a.parquet", tmp_path / "b.jsonl"])
    assert [t.prompt[0]["content"] for t in tasks] == [f"What is {i} + 1?" for i in range(6)]
    # SkyRL's extras: every field but prompt and env_class.
    assert tasks[4].env_extras == {
        "reward_spec": {"method": "rule", "ground_truth": "5"},
        "data_source": "toy/even",
        "extra_info": {"index": 4},
    }
    assert [t.data_source for t in tasks[:2]] == ["toy/even", "toy/odd"]
    env = skyrl_gym.make(tasks[4].env_name, extras=tasks[4].env_extras)
    env.init(tasks[4].prompt)
    assert env.step("5")["reward"] == 1.0


def test_rows_without_env_class_or_source_take_the_defaults(tmp_path: Path) -> None:
    rows = [_row(0, env_class=None, data_source=None), _row(1)]
    for row in rows:
        row.pop("extra_info")
    tasks = _load([_jsonl(tmp_path / "d.jsonl", rows)])
    assert tasks[0].env_name == ExactAnswerEnv.name
    assert tasks[0].data_source == ExactAnswerEnv.name  # no source: the environment's name
    assert "extra_info" not in tasks[0].env_extras


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reward_spec": None}, "env_class"),  # optional in a row: its environment refuses
        ({"prompt": "What is 1 + 1?"}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [{"role": "user", "content": 7}]}, "prompt[0].content"),
        ({"env_class": "no_such_env"}, "env_class"),
        ({"reward_spec": {"ground_truth": "2"}}, "reward_spec.method"),
        ({"reward_spec": {"method": "rule"}}, "reward_spec.ground_truth"),
        ({"data_source": 3}, "data_source"),
        ({"extra_info": [1, 2]}, "extra_info"),
    ],
)
def test_a_bad_row_names_the_file_the_row_and_the_key(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    rows = [_row(0), _row(1), _row(2, **change), _row(3)]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        _load([path])
    err = info.value
    assert (err.path, err.file, err.row, err.field) == ("data.train_data[0]", path, 2, field)
    assert str(err).startswith(f"data.train_data[0]: {path} row 2: {field}: ")
    assert isinstance(err, ConfigValidationError)


def test_a_row_its_environment_refuses_is_reported_before_the_run(tmp_path: Path) -> None:
    # guess_number takes a target, not a reward_spec: its constructor refuses the row.
    path = _jsonl(tmp_path / "rows.jsonl", [_row(0), _row(1, env_class="guess_number")])
    with pytest.raises(DatasetError) as info:
        _load([path])
    assert (info.value.row, info.value.field) == (1, "env_class")
    assert "guess_number" in str(info.value)


def test_a_malformed_json_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n" + '{"prompt": [\n' + json.dumps(_row(2)) + "\n")
    with pytest.raises(DatasetError) as info:
        read_rows(path, key="data.val_data[0]")
    assert (info.value.path, info.value.row) == ("data.val_data[0]", 1)


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([_row(0)]).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="expected rows, got none"):
        _load([tmp_path / "empty.parquet"])


def test_steps_walk_epochs_deterministically(tmp_path: Path) -> None:
    tasks = _load([_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(10)])])
    batches = [sample_step(tasks, batch_size=4, seed=3, step=s) for s in range(1, 6)]
    # The same (seed, step) gives the same prompts: a resumed run repeats none and skips none.
    assert batches[2] == sample_step(tasks, batch_size=4, seed=3, step=3)
    assert sample_step(tasks, batch_size=4, seed=4, step=1) != batches[0]
    flat = [t.prompt[0]["content"] for batch in batches for t in batch]
    # Epoch 1 is the first 10 draws, epoch 2 the next 10: each row once per epoch,
    # step 3 straddling the boundary.
    assert Counter(flat[:10]) == Counter(t.prompt[0]["content"] for t in tasks)
    assert Counter(flat[10:20]) == Counter(t.prompt[0]["content"] for t in tasks)
    assert flat[:10] != flat[10:20]  # a fresh permutation per epoch


def test_extra_sampling_rounds_draw_their_own_reproducible_prompts(tmp_path: Path) -> None:
    tasks = _load([_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(10)])])
    first = sample_step(tasks, batch_size=4, seed=3, step=2)
    assert sample_step(tasks, batch_size=4, seed=3, step=2, round=0) == first
    extra = [sample_step(tasks, batch_size=4, seed=3, step=2, round=r) for r in (1, 2)]
    assert extra[0] != first and extra[1] != extra[0]
    assert extra[0] == sample_step(tasks, batch_size=4, seed=3, step=2, round=1)


def test_without_files_the_generated_datasets_are_used() -> None:
    cfg = load_config(["trainer.eval_batch_size=5"])
    datasets = load_datasets(cfg)
    assert len(datasets.train) == 4096 and len(datasets.eval) == 5
    assert {t.env_name for t in datasets.train} == {"repeat_letter"}
    assert {t.data_source for t in datasets.eval} == {"repeat_letter"}


def test_validation_files_drive_evaluation(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [_row(i) for i in range(4)])
    val = _jsonl(tmp_path / "val.jsonl", [_row(i) for i in range(10, 13)])
    cfg = load_config([f"data.train_data=[{train}]", f"data.val_data=[{val}]"])
    datasets = load_datasets(cfg)
    assert len(datasets.train) == 4
    assert [t.prompt[0]["content"] for t in datasets.eval] == [
        f"What is {i} + 1?" for i in range(10, 13)
    ]


def test_a_bad_row_stops_the_launch_before_ray(tmp_path: Path) -> None:
    from skyrl_train.entrypoints.main_base import launch

    train = _jsonl(tmp_path / "train.jsonl", [_row(0), _row(1, prompt=[])])
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            f"data.train_data=[{train}]",
            f"trainer.run_dir={run_dir}",
        ]
    )
    with pytest.raises(DatasetError) as info:
        with launch(cfg):
            pass
    assert (info.value.row, info.value.field) == (1, "prompt")
    assert not ray.is_initialized()


def test_missing_data_files_fail_validation(tmp_path: Path) -> None:
    from skyrl_train.config.validate import validate_cfg

    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config([f"data.val_data=[{tmp_path / 'nope.parquet'}]"]))
    assert info.value.path == "data.val_data[0]" and "existing file" in info.value.reason
    (tmp_path / "rows.csv").write_text("x\n")
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config([f"data.train_data=[{tmp_path / 'rows.csv'}]"]))
    assert info.value.path == "data.train_data[0]" and ".parquet" in info.value.reason
