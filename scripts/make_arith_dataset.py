"""Write a small arithmetic word-problem dataset in the training row schema.

    python scripts/make_arith_dataset.py --out data/arith [--seed 0] [--train 512] [--val 64]
        [--env-class gsm8k|calculator]

Rows come from the environment's own seeded sampler (``skyrl_gym.make_dataset``), so
prompt wording and ``reward_spec`` are exactly what that environment grades; written
as ``train.parquet`` and ``validation.parquet`` with pyarrow. Validation rows whose
question also appears in training are dropped, so evaluation is on unseen prompts.
The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import skyrl_gym

# A validation seed far from any training seed a user would pick.
_VAL_SEED_OFFSET = 7_919_000


def rows(env_class: str, *, count: int, seed: int, split: str) -> list[dict[str, Any]]:
    tasks = skyrl_gym.make_dataset(env_class, num_prompts=count, seed=seed)
    out = []
    for index, task in enumerate(tasks):
        extras = dict(task.env_extras)
        out.append(
            {
                "prompt": task.prompt,
                "env_class": task.env_name,
                "reward_spec": extras["reward_spec"],
                "data_source": f"arith/{env_class}",
                "extra_info": {**extras.get("extra_info", {}), "split": split, "index": index},
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=512, help="training rows")
    parser.add_argument("--val", type=int, default=64, help="validation rows (before dedup)")
    parser.add_argument("--env-class", default="gsm8k", choices=("gsm8k", "calculator"))
    args = parser.parse_args(argv)
    if args.train < 1 or args.val < 1:
        parser.error(f"--train/--val: expected >= 1, got {args.train}/{args.val}")

    import pyarrow as pa
    import pyarrow.parquet as pq

    train = rows(args.env_class, count=args.train, seed=args.seed, split="train")
    seen = {row["prompt"][-1]["content"] for row in train}
    val = [
        row
        for row in rows(
            args.env_class, count=args.val, seed=args.seed + _VAL_SEED_OFFSET, split="validation"
        )
        if row["prompt"][-1]["content"] not in seen
    ]
    if not val:
        parser.error("--val: every validation question also appeared in training")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in (("train", train), ("validation", val)):
        path = args.out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table), path)
        print(f"{path}: {len(table)} rows ({args.env_class})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
