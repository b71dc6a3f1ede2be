"""End to end on dataset files: the README's command, with validation rows, and
SkyRL users' environments in the same run.

A checkpoint from ``scripts/make_checkpoint.py``'s library function; training rows in
SkyRL's schema from three sources: the arithmetic dataset of
``scripts/make_arith_dataset.py`` (``gsm8k``), text-to-SQL rows over a generated
SQLite database (``text2sql``, a tool call per turn), and an environment file written
for SkyRL (``skyrl_plugin/word_length_env.py``), copied in unchanged and registered
through the ``skyrl_gym.envs`` entry-point group, as ``pip install`` of a plugin
would. Three steps with R3: every turn's routes replay.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from _e2e import SMALL

import skyrl_gym
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_gym.envs import registration
from skyrl_gym.envs.sql.local_db import DB_ID, database_file, make_database, make_text2sql_rows
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import run
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "make_arith_dataset.py"
PLUGIN = Path(__file__).resolve().parent / "skyrl_plugin"


def _make_dataset(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_arith_dataset", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(out), "--train", "16", "--val", "3", "--seed", "5"]) == 0


@pytest.fixture
def word_length_plugin(tmp_path: Path) -> Iterator[str]:
    """The SkyRL file installed as a distribution declaring it in the entry-point group."""
    info = tmp_path / "plugin" / "skyrl_word_length-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skyrl-word-length\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[skyrl_gym.envs]\nword_length = word_length_env:WordLengthEnv\n"
    )
    paths = [str(tmp_path / "plugin"), str(PLUGIN)]
    sys.path[:0] = paths
    registration.reload_entry_points()
    try:
        yield "word_length"
    finally:
        for path in paths:
            sys.path.remove(path)
        sys.modules.pop("word_length_env", None)
        skyrl_gym.deregister("word_length")
        registration.reload_entry_points()


def _skyrl_rows(tmp_path: Path, env_class: str) -> tuple[Path, Path]:
    """Training rows in SkyRL's schema: word-length questions and text-to-SQL ones."""
    words = ["gym", "route", "expert", "replay"]
    rows = [
        {
            "prompt": [
                {"role": "user", "content": f"Length of '{w}'? <len>w</len> or <answer>N</answer>"}
            ],
            "env_class": env_class,
            "reward_spec": {"method": "rule", "ground_truth": str(len(w))},
            "data_source": "words",
            "extra_info": {"index": i},
        }
        for i, w in enumerate(words)
    ]
    words_file = tmp_path / "words.parquet"
    pq.write_table(pa.Table.from_pylist(rows), words_file)
    make_database(database_file(tmp_path / "sql", DB_ID), seed=0)
    sql_file = tmp_path / "sql.parquet"
    pq.write_table(
        pa.Table.from_pylist(make_text2sql_rows(tmp_path / "sql", count=4, seed=1)), sql_file
    )
    return words_file, sql_file


def test_three_steps_on_dataset_files_and_skyrl_environments(
    tmp_path: Path, word_length_plugin: str
) -> None:
    checkpoint = write_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=0)
    _make_dataset(tmp_path / "data")
    words, sql = _skyrl_rows(tmp_path, word_length_plugin)
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            *[o for o in SMALL if not o.startswith(("environment.", "+environment."))],
            f"model.path={checkpoint}",
            f"data.train_data=[{tmp_path / 'data' / 'train.parquet'},{words},{sql}]",
            f"data.val_data=[{tmp_path / 'data' / 'validation.parquet'}]",
            "environment.env_class=gsm8k",
            f"+environment.skyrl_gym.text2sql.db_path={tmp_path / 'sql'}",
            "+environment.skyrl_gym.word_length.format_bonus=0.1",
            "trainer.num_steps=3",
            "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=4",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=2",
            "generator.max_tokens_per_turn=16",
            f"trainer.run_dir={run_dir}",
            "logging.plot=false",
        ]
    )
    history = run(cfg)
    assert len(history) == 3
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    final = rows[-1]
    # Evaluation ran on the validation rows, and is reported per data source.
    for key in ("eval/reward_mean", "eval/reward_mean/arith/gsm8k", "reward/mean"):
        assert math.isfinite(final[key]), key
    assert final["eval/reward_mean"] == final["eval/reward_mean/arith/gsm8k"]
    # Every source trained; multi-turn rows took a second turn after the tool's output;
    # the routes of every turn replayed.
    sources = {key for row in rows for key in row if key.startswith("reward/")}
    assert {"reward/words", "reward/local_sql"} <= sources, sources
    assert max(row["generate/mean_turns"] for row in rows) > 1.0
    for row in rows:
        assert row["r3/router_agreement_trained"] == 1.0 and row["generate/route_rows"] > 0
    assert any("environment/word_length/turns" in row for row in rows)
    assert not ray.is_initialized()
