"""A small generated company database and text2sql questions about it.

    make_database(root / "company" / "company.sqlite", seed=0)
    rows = make_text2sql_rows(root, count=200, seed=1)

The database (``DB_ID`` = "company") has two tables, ``SCHEMA`` in the prompt's words:
6 departments in a few cities and 48 employees with a salary and a hiring year, all
drawn from ``seed``, so the same seed gives the same rows. The questions are short
templates (count, list, max/min, lookup by name) whose parameters are read from the
database itself, so each gold query returns a non-empty result there. Prompts stay
under ~300 characters: the project's byte-level model pays one token per byte.
"""

from __future__ import annotations

import os
import random
import sqlite3
from pathlib import Path
from typing import Any

from skyrl_gym.error import EnvError
from skyrl_gym.tools.sql import run_readonly_query

DB_ID = "company"
DATA = "local"
"""``extras.data`` for these rows: ``<db_path>/<db_id>/<db_id>.sqlite`` directly."""
DATA_SOURCE = "local_sql"
SCHEMA = "Tables: departments(id, name, city); employees(id, name, dept_id, salary, hired)."
INSTRUCTIONS = (
    "Think in <think>...</think>. Run a query with <sql>...</sql>; "
    "give the final query as <solution>...</solution>."
)
_DDL = (
    "CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL)",
    "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
    "dept_id INTEGER NOT NULL REFERENCES departments(id), salary INTEGER NOT NULL, "
    "hired INTEGER NOT NULL)",
)
_DEPARTMENTS = ("Engineering", "Sales", "Marketing", "Finance", "Support", "Research")
_CITIES = ("Berlin", "Lisbon", "Oslo", "Austin")
_FIRST = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
_LAST = ("Berg", "Costa", "Diaz", "Ek", "Fox", "Gray", "Holm", "Ito")
EMPLOYEES = 48

_JOIN = "FROM employees e JOIN departments d ON e.dept_id = d.id"
_TEMPLATES: dict[str, tuple[str, str, str]] = {
    # name: (question, gold SQL, the query whose rows give the parameter)
    "count_dept": (
        "How many employees work in {p}?",
        f"SELECT COUNT(*) {_JOIN} WHERE d.name = '{{p}}';",
        "SELECT name FROM departments",
    ),
    "names_city": (
        "List the names of the employees based in {p}.",
        f"SELECT e.name {_JOIN} WHERE d.city = '{{p}}';",
        "SELECT DISTINCT city FROM departments",
    ),
    "max_salary_dept": (
        "What is the highest salary in {p}?",
        f"SELECT MAX(e.salary) {_JOIN} WHERE d.name = '{{p}}';",
        "SELECT name FROM departments",
    ),
    "first_hire_dept": (
        "In which year did {p} hire its first employee?",
        f"SELECT MIN(e.hired) {_JOIN} WHERE d.name = '{{p}}';",
        "SELECT name FROM departments",
    ),
    "hired_in": (
        "Who was hired in {p}?",
        "SELECT name FROM employees WHERE hired = {p};",
        "SELECT DISTINCT hired FROM employees",
    ),
    "earns_over": (
        "Which employees earn more than {p}?",
        "SELECT name FROM employees WHERE salary > {p};",
        "SELECT salary - 1 FROM employees",
    ),
    "dept_of": (
        "Which department does {p} work in?",
        f"SELECT d.name {_JOIN} WHERE e.name = '{{p}}';",
        "SELECT name FROM employees",
    ),
    "depts_city": (
        "How many departments are in {p}?",
        "SELECT COUNT(*) FROM departments WHERE city = '{p}';",
        "SELECT DISTINCT city FROM departments",
    ),
}


def database_file(db_root: str | os.PathLike[str], db_id: str = DB_ID) -> Path:
    """Where the environment looks for ``db_id`` with ``extras.data == "local"``."""
    return Path(db_root) / db_id / f"{db_id}.sqlite"


def _tables(rng: random.Random) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    departments = [(i + 1, name, rng.choice(_CITIES)) for i, name in enumerate(_DEPARTMENTS)]
    names = rng.sample([f"{a} {b}" for a in _FIRST for b in _LAST], EMPLOYEES)
    employees = [
        (
            i + 1,
            name,
            rng.randint(1, len(departments)),
            rng.randrange(30_000, 150_001, 500),
            rng.randint(2010, 2024),
        )
        for i, name in enumerate(names)
    ]
    return departments, employees


def make_database(path: str | os.PathLike[str], *, seed: int) -> Path:
    """Write the company database to ``path`` (replacing one there), its rows drawn
    from ``seed``; written beside it first and moved in place, so a reader never sees
    a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    departments, employees = _tables(random.Random(seed))
    conn = sqlite3.connect(partial)
    try:
        with conn:
            for statement in _DDL:
                conn.execute(statement)
            conn.executemany("INSERT INTO departments VALUES (?, ?, ?)", departments)
            conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", employees)
    finally:
        conn.close()
    os.replace(partial, target)
    return target


def text2sql_prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question}\n{SCHEMA}\n{INSTRUCTIONS}"}]


def _values(db_file: Path, sql: str) -> list[Any]:
    result = run_readonly_query(db_file, sql, timeout=5.0, max_rows=10_000)
    if result.rows is None or not result.rows:
        raise EnvError(
            f"make_text2sql_rows.db_root: expected the company database at "
            f"{db_file}, got {result.error or 'no rows'} for {sql!r}"
        )
    return sorted({row[0] for row in result.rows})


def make_text2sql_rows(
    db_root: str | os.PathLike[str], *, count: int, seed: int
) -> list[dict[str, Any]]:
    """``count`` dataset rows (SkyRL's text2sql schema) about the database that
    ``make_database`` wrote under ``db_root``; the same seed gives the same rows."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise EnvError(f"make_text2sql_rows.count: expected an int >= 0, got {count!r}")
    db_file = database_file(db_root)
    if not db_file.is_file():
        raise EnvError(
            f"make_text2sql_rows.db_root: expected {db_file} (write it with make_database), "
            "got no such file"
        )
    choices = {name: _values(db_file, source) for name, (_, _, source) in _TEMPLATES.items()}
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        name = rng.choice(sorted(_TEMPLATES))
        question, gold, _ = _TEMPLATES[name]
        value = rng.choice(choices[name])
        rows.append(
            {
                "prompt": text2sql_prompt(question.format(p=value)),
                "env_class": "text2sql",
                "reward_spec": {"method": "rule", "ground_truth": gold.format(p=value)},
                "db_id": DB_ID,
                "data": DATA,
                "data_source": DATA_SOURCE,
                # parquet cannot store an empty struct, so extra_info is never {}
                "extra_info": {"index": index, "template": name},
            }
        )
    return rows
