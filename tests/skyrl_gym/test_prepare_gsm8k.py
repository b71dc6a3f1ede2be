"""scripts/prepare_gsm8k.py on small parquet files shaped like the public GSM8K ones."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import skyrl_gym
from skyrl_gym.envs.gsm8k import INSTRUCTION

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import prepare_gsm8k
finally:
    sys.path.remove(str(REPO / "scripts"))

TRAIN = [
    ("Ann has 3 pens and buys 4. How many?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box costs $1,200. What do 2 cost?", "2 * 1200 = 2400\n#### 2,400"),
    ("It drops 5 degrees from 2. Now?", "2 - 5 = -3\n#### -3"),
]
TEST = [("Half of 9?", "9 / 2 = 4.5\n#### 4.5")]


def write(path: Path, rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    questions, answers = zip(*rows, strict=True)
    pq.write_table(pa.table({"question": list(questions), "answer": list(answers)}), path)


@pytest.mark.parametrize("layout", ["flat", "main"])
def test_converts_both_splits_into_dataset_rows(tmp_path: Path, capsys, layout: str) -> None:
    src = tmp_path / "gsm8k" / ("main" if layout == "main" else "")
    write(src / "train-00000-of-00002.parquet", TRAIN[:2])
    write(src / "train-00001-of-00002.parquet", TRAIN[2:])
    write(src / "test-00000-of-00001.parquet", TEST)
    out = tmp_path / "out"
    assert prepare_gsm8k.main(["--in", str(tmp_path / "gsm8k"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"train: 3 rows -> {out / 'train.parquet'}" in printed
    assert f"test: 1 rows -> {out / 'validation.parquet'}" in printed

    train = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["reward_spec"] for r in train] == [
        {"method": "rule", "ground_truth": "7"},
        {"method": "rule", "ground_truth": "2400"},
        {"method": "rule", "ground_truth": "-3"},
    ]
    assert [r["extra_info"] for r in train] == [
        {"split": "train", "index": i} for i in range(3)
    ]  # shards concatenated in order
    first = train[0]
    assert first["env_class"] == "gsm8k" and first["data_source"] == "openai/gsm8k"
    assert first["prompt"] == [{"role": "user", "content": f"{TRAIN[0][0]}\n{INSTRUCTION}"}]
    (valid,) = pq.read_table(out / "validation.parquet").to_pylist()
    assert valid["extra_info"] == {"split": "test", "index": 0}

    # The loader's contract: each row builds its env and the reference solution scores 1.
    for row, (_, solution) in zip([*train, valid], [*TRAIN, *TEST], strict=True):
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        env = skyrl_gym.make(row["env_class"], extras=extras)
        env.init(row["prompt"])
        assert env.step(solution)["reward"] == 1.0


def test_refuses_an_answer_without_a_final_marker_naming_file_and_row(tmp_path: Path, capsys):
    write(tmp_path / "train-0.parquet", [TRAIN[0], ("Q?", "The answer is 5.")])
    write(tmp_path / "test-0.parquet", TEST)
    assert prepare_gsm8k.main(["--in", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'train-0.parquet'} row 1.answer: expected a last line '#### <number>'" in err
    )
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("train_rows", "columns", "message"),
    [
        ([("Q?", "#### seven")], None, "row 0.answer: expected a last line"),
        ([("Q?", "#### 5\nthanks")], None, "row 0.answer: expected a last line"),
        ([("", "#### 5")], None, "row 0.question: expected non-empty text"),
        ([("Q?", "#### 5")], ["question", "solution"], r"missing \['answer'\]"),
    ],
)
def test_refuses_malformed_rows(tmp_path: Path, capsys, train_rows, columns, message) -> None:
    write(tmp_path / "test-0.parquet", TEST)
    if columns is None:
        write(tmp_path / "train-0.parquet", train_rows)
    else:
        q, a = zip(*train_rows, strict=True)
        pq.write_table(
            pa.table(dict(zip(columns, [list(q), list(a)], strict=True))),
            tmp_path / "train-0.parquet",
        )
    assert prepare_gsm8k.main(["--in", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_refuses_a_folder_without_the_split_files(tmp_path: Path, capsys) -> None:
    write(tmp_path / "train-0.parquet", TRAIN)
    assert prepare_gsm8k.main(["--in", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "expected test-*.parquet in it or in its main/ folder" in capsys.readouterr().err
