"""Turn the public GSM8K parquet files into this project's dataset rows, offline.

    python scripts/prepare_gsm8k.py --in ~/data/gsm8k --out data/gsm8k

``--in`` holds ``train-*.parquet`` and ``test-*.parquet`` (columns ``question`` and
``answer``), directly or under ``main/`` as the Hugging Face repository lays them out.
``--out`` receives ``train.parquet`` (from train) and ``validation.parquet`` (from
test), one row per problem::

    prompt       [{"role": "user", "content": question + gsm8k.INSTRUCTION}]
    env_class    "gsm8k"
    reward_spec  {"method": "rule", "ground_truth": "<canonical number>"}
    data_source  "openai/gsm8k"
    extra_info   {"split": "train" | "test", "index": row number within that split}

An answer whose last line is not ``#### <number>`` stops the run, naming file and row:
a silently dropped row would shift every later ``index``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_gym.envs.answers import normalize_number  # noqa: E402
from skyrl_gym.envs.gsm8k import gsm8k_prompt  # noqa: E402

DATA_SOURCE = "openai/gsm8k"
SPLITS = {"train": "train.parquet", "test": "validation.parquet"}
"""Source split -> output file; GSM8K has no validation split, so test serves as one."""


class PrepareError(ValueError):
    """A missing input file or a row that cannot become a dataset row."""


def find_split_files(root: Path, split: str) -> list[Path]:
    """``split-*.parquet`` in ``root``, else in ``root/main``, sorted shard order."""
    for folder in (root, root / "main"):
        files = sorted(folder.glob(f"{split}-*.parquet"))
        if files:
            return files
    raise PrepareError(
        f"--in {root}: expected {split}-*.parquet in it or in its main/ folder, found none"
    )


def ground_truth(answer: Any, where: str) -> str:
    """The canonical number of a GSM8K answer's last line, ``#### N``."""
    lines = answer.strip().splitlines() if isinstance(answer, str) else []
    last = lines[-1].strip() if lines else ""
    number = normalize_number(last[4:]) if last.startswith("####") else None
    if number is None:
        raise PrepareError(
            f"{where}.answer: expected a last line '#### <number>', got {last or answer!r:.80}"
        )
    return number


def convert_split(files: list[Path], split: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in files:
        table = pq.read_table(path)
        missing = {"question", "answer"} - set(table.column_names)
        if missing:
            raise PrepareError(
                f"{path}: expected columns 'question' and 'answer', missing {sorted(missing)}"
            )
        questions = table.column("question").to_pylist()
        answers = table.column("answer").to_pylist()
        for row, (question, answer) in enumerate(zip(questions, answers, strict=True)):
            where = f"{path} row {row}"
            if not isinstance(question, str) or not question.strip():
                raise PrepareError(f"{where}.question: expected non-empty text, got {question!r}")
            rows.append(
                {
                    "prompt": gsm8k_prompt(question),
                    "env_class": "gsm8k",
                    "reward_spec": {"method": "rule", "ground_truth": ground_truth(answer, where)},
                    "data_source": DATA_SOURCE,
                    "extra_info": {"split": split, "index": len(rows)},
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/prepare_gsm8k.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--in", dest="src", required=True, type=Path, help="GSM8K parquet folder")
    parser.add_argument("--out", required=True, type=Path, help="folder for the two outputs")
    args = parser.parse_args(argv)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        parser.error("pyarrow is required: pip install pyarrow")

    try:
        converted = {
            split: convert_split(find_split_files(args.src, split), split) for split in SPLITS
        }
    except PrepareError as exc:
        print(f"prepare_gsm8k: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for split, rows in converted.items():
        target = args.out / SPLITS[split]
        pq.write_table(pa.Table.from_pylist(rows), target)
        print(f"{split}: {len(rows)} rows -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
