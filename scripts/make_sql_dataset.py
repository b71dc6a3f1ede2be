"""Write the local text2sql database and a small training dataset for it, offline.

    python scripts/make_sql_dataset.py --out data/text2sql
    python scripts/make_sql_dataset.py --out data/text2sql --db-root /tmp/sql_data \\
        --train 500 --validation 50 --seed 7

Writes ``<db-root>/company/company.sqlite`` (``skyrl_gym/envs/sql/local_db.py``; the
default ``--db-root`` is the environment's default ``db_path``,
``~/.cache/skyrl_gym/sql_data``) and, under ``--out``, ``train.parquet`` and
``validation.parquet``: one row per question in SkyRL's text2sql schema (``prompt``,
``env_class`` "text2sql", ``reward_spec``, ``db_id``, ``data`` "local",
``data_source``, ``extra_info``). With another ``--db-root``, point the environment
at it: ``environment.skyrl_gym.text2sql.db_path=<db-root>``. The same ``--seed``
gives the same database and rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_gym.envs.sql.env import DEFAULT_DB_PATH  # noqa: E402
from skyrl_gym.envs.sql.local_db import (  # noqa: E402
    database_file,
    make_database,
    make_text2sql_rows,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/make_sql_dataset.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for the parquet files")
    parser.add_argument(
        "--db-root",
        type=Path,
        default=Path(DEFAULT_DB_PATH).expanduser(),
        help="root folder of the databases (the environment's db_path)",
    )
    parser.add_argument("--train", type=int, default=200, help="training rows")
    parser.add_argument("--validation", type=int, default=50, help="validation rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train < 1 or args.validation < 1:
        parser.error("--train and --validation: expected counts >= 1")
    import pyarrow as pa
    import pyarrow.parquet as pq

    db_file = make_database(database_file(args.db_root), seed=args.seed)
    print(f"database -> {db_file}")
    args.out.mkdir(parents=True, exist_ok=True)
    # Distinct seeds per split; questions may still repeat, the pool is small by design.
    for split, count, seed in (
        ("train", args.train, 2 * args.seed + 1),
        ("validation", args.validation, 2 * args.seed + 2),
    ):
        rows = make_text2sql_rows(args.db_root, count=count, seed=seed)
        target = args.out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), target)
        print(f"{split}: {len(rows)} rows -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
