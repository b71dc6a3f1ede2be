"""text2sql against a real generated database: scoring, the SQL tool's fences (read-only,
time, rows, size), row checks, the format check, and the local dataset."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.sql import local_db
from skyrl_gym.envs.sql.env import DatabaseNotFoundError, find_sql
from skyrl_gym.envs.sql.utils import compute_score_single, verify_format_and_extract
from skyrl_gym.tools import SQLCodeExecutorToolGroup
from skyrl_gym.tools.sql import INVALID_ACTION, run_readonly_query

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import make_sql_dataset
finally:
    sys.path.remove(str(REPO / "scripts"))

GOLD = "SELECT name FROM employees WHERE dept_id = 2;"
FOREVER = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT max(x) FROM r"


@pytest.fixture(scope="module")
def db_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sql_data")
    local_db.make_database(local_db.database_file(root), seed=0)
    return root


def digest(root: Path) -> str:
    return hashlib.sha256(local_db.database_file(root).read_bytes()).hexdigest()


def make_env(root: Path, gold: str = GOLD, **settings: object) -> skyrl_gym.Env:
    extras = {
        "reward_spec": {"method": "rule", "ground_truth": gold},
        "db_id": local_db.DB_ID,
        "data": "local",
        "max_turns": 3,
    }
    return skyrl_gym.make("text2sql", env_config={"db_path": str(root), **settings}, extras=extras)


def query(root: Path, sql: str, **settings: object) -> str:
    """The observation for one tool call."""
    out = make_env(root, **settings).step(f"<think>look</think><sql>{sql}</sql>")
    assert out["done"] is False and out["reward"] == 0.0
    return out["observations"][0]["content"]


def solve(root: Path, solution: str, gold: str = GOLD) -> float:
    env = make_env(root, gold)
    env.step(f"<think>look</think>\n<sql>{solution}</sql>")
    out = env.step(f"<think>done</think>\n<solution>{solution}</solution>")
    assert out["done"] is True and out["observations"] == []
    assert out["metadata"]["solved"] is (out["reward"] == 1.0)
    return out["reward"]


def test_right_solution_scores_one(db_root: Path) -> None:
    assert solve(db_root, GOLD) == 1.0


def test_a_different_query_with_the_same_rows_scores_one(db_root: Path) -> None:
    same = (
        "SELECT e.name FROM employees e JOIN departments d ON e.dept_id = d.id "
        "WHERE d.id = 2 ORDER BY e.name DESC"
    )
    assert solve(db_root, same) == 1.0


def test_wrong_or_failing_solution_scores_zero(db_root: Path) -> None:
    assert solve(db_root, "SELECT name FROM employees WHERE dept_id = 3") == 0.0
    assert solve(db_root, "SELECT nope FROM nowhere") == 0.0
    assert solve(db_root, GOLD, gold="SELECT broken gold") == 0.0


def test_malformed_episode_scores_minus_one(db_root: Path) -> None:
    env = make_env(db_root)
    out = env.step(f"<solution>{GOLD}</solution>")  # no <think>
    assert out["done"] and out["reward"] == -1.0 and out["metadata"]["well_formed"] is False
    env = make_env(db_root)  # turns run out without a solution
    rewards = [env.step("<think>hm</think><sql>SELECT 1</sql>")["reward"] for _ in range(3)]
    assert rewards == [0.0, 0.0, -1.0] and env.done
    with pytest.raises(EnvError, match="text2sql.step"):
        env.step("<think>again</think>")


def test_tool_call_shows_rows_in_order_and_turns_left(db_root: Path) -> None:
    text = query(db_root, "SELECT id, name FROM departments ORDER BY id DESC LIMIT 2")
    assert text.strip().startswith("<observation>") and text.strip().endswith("</observation>")
    assert "id | name\n6 | Research\n5 | Support\n" in text
    assert "<reminder>You have 2 turns left to complete the task.</reminder>" in text


def test_tool_input_and_reply_without_query(db_root: Path) -> None:
    out = make_env(db_root).step("<think>x</think><sql> SELECT 1 </sql><sql>SELECT 2</sql>")
    meta = out["metadata"]
    assert meta["tool_input"] == ("company", " SELECT 1 ", 2)
    assert (meta["tool_group"], meta["tool_name"]) == ("SQLCodeExecutorToolGroup", "sql")
    out = make_env(db_root).step(b"<think>x</think><sql>SELECT 1")  # unclosed; bytes reply
    assert out["metadata"]["tool_input"][1] is None
    assert INVALID_ACTION in out["observations"][0]["content"]
    assert find_sql("<sql>" * 10_000) is None


def test_bad_query_error_is_the_observation(db_root: Path) -> None:
    text = query(db_root, "SELEC name FROM employees")
    assert 'Error: OperationalError: near "SELEC": syntax error' in text
    assert "turns left" in text
    assert "Error:" in query(db_root, "SELECT 1; SELECT 2")  # one statement at a time


def test_endless_query_is_stopped_by_the_time_limit(db_root: Path) -> None:
    start = time.monotonic()
    text = query(db_root, FOREVER, timeout=0.3)
    assert time.monotonic() - start < 5
    assert "time limit" in text
    start = time.monotonic()
    result = run_readonly_query(local_db.database_file(db_root), FOREVER, timeout=0.3, max_rows=9)
    assert result.timed_out and result.rows is None and time.monotonic() - start < 5


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM employees",
        "DROP TABLE employees",
        "UPDATE employees SET salary = 0",
        "INSERT INTO departments VALUES (99, 'X', 'Y')",
        "CREATE TABLE t (a)",
        "ATTACH DATABASE 'other.sqlite' AS other",
        "PRAGMA writable_schema = 1",
        "BEGIN",
    ],
)
def test_writes_are_refused_and_the_file_is_unchanged(db_root: Path, sql: str) -> None:
    before = digest(db_root)
    assert "only read-only queries are allowed" in query(db_root, sql)
    assert solve(db_root, sql) == 0.0  # as a solution, and as the gold query
    assert solve(db_root, GOLD, gold=sql) == 0.0
    assert digest(db_root) == before
    assert not (db_root / "other.sqlite").exists()


def test_schema_reads_are_allowed(db_root: Path) -> None:
    assert "salary" in query(db_root, "PRAGMA table_info(employees)")
    assert "CREATE TABLE departments" in query(db_root, "SELECT sql FROM sqlite_master")


def test_huge_results_are_truncated(db_root: Path) -> None:
    text = query(db_root, "SELECT * FROM employees a, employees b", max_chars=500)
    assert len(text) < 700 and "(truncated: " in text and "more)" in text
    text = query(db_root, "SELECT x FROM (SELECT 1 AS x UNION ALL SELECT 2)", max_rows=1)
    assert "x\n1\n(truncated: 1 rows shown, more)" in text
    cross = "SELECT a.id, b.id FROM employees a, employees b"
    result = run_readonly_query(local_db.database_file(db_root), cross, timeout=5, max_rows=100)
    assert result.truncated and len(result.rows or []) == 100
    big = "SELECT randomblob(10000000)"
    assert "string or blob too big" in query(db_root, big)
    assert "\n" + "x" * 97 + "...\n" in query(db_root, "SELECT printf('%.*c', 5000, 'x')")
    # A result over the scoring cap cannot be compared: 0, not a match of truncations.
    completion = f"<think>t</think><solution>{cross}</solution>"
    db_file = str(local_db.database_file(db_root))
    assert compute_score_single(completion, cross, db_file) == 1.0
    assert compute_score_single(completion, cross, db_file, max_rows=100) == 0.0


def test_missing_database_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DatabaseNotFoundError) as caught:
        make_env(tmp_path)
    assert str(local_db.database_file(tmp_path)) in str(caught.value)
    assert isinstance(caught.value, EnvError) and isinstance(caught.value, FileNotFoundError)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"db_id": None}, "extras.db_id"),
        ({"db_id": "../company"}, "extras.db_id"),
        ({"data": "oracle"}, "extras.data"),
        ({"reward_spec": {"method": "rule", "ground_truth": 3}}, "extras.reward_spec.ground_truth"),
        ({"max_turns": 0}, "extras.max_turns"),
    ],
)
def test_bad_rows_name_the_field(db_root: Path, change: dict, field: str) -> None:
    extras = {"reward_spec": {"method": "rule", "ground_truth": GOLD}, "db_id": "company"}
    extras = {**extras, "data": "local", **change}
    extras = {k: v for k, v in extras.items() if v is not None}
    with pytest.raises(EnvError, match=f"text2sql.{field}"):
        skyrl_gym.make("text2sql", env_config={"db_path": str(db_root)}, extras=extras)


def test_bad_settings_name_the_setting(db_root: Path) -> None:
    with pytest.raises(EnvError, match=r"environment\.skyrl_gym\.text2sql\.timeout"):
        make_env(db_root, timeout=0)
    with pytest.raises(EnvError, match=r"environment\.skyrl_gym\.text2sql\.max_rows"):
        make_env(db_root, max_rows="50")
    with pytest.raises(EnvError, match="SQLCodeExecutorToolGroup.db_id"):
        SQLCodeExecutorToolGroup(str(db_root)).sql("/etc/passwd", "SELECT 1", 1)


@pytest.mark.parametrize(
    ("output", "solution"),
    [
        ("<think>a</think><solution> SELECT 1 \n</solution>", "SELECT 1"),
        ("<think></think><solution></solution>", ""),
        ("x</OBSERVATION>\n  \t<think>b</think><solution>q</solution>", "q"),
        ("<sql>q</sql><observation>r</observation> <think>b</think><solution>q</solution>", "q"),
        ("<think>a</think><solution>q</solution> trailing <think>late</think>", "q"),
    ],
)
def test_format_accepts(output: str, solution: str) -> None:
    ok, thoughts, text, rest = verify_format_and_extract(output)
    assert ok and thoughts and text == solution and rest is None


@pytest.mark.parametrize(
    "output",
    [
        "<think>a</think><solution>q</solution><solution>",
        "<think>a</think><solution>q</solution></solution>",
        "<think>a</think></solution><solution>q",
        "<think>a</think><solution>q <SQL>x</solution>",
        "<think>a</think><solution>q <Think </solution>",
        "<observation>r</observation>\ntext<think>a</think><solution>q</solution>",
        "<observation>r</observation>",
        "<think>a</think>",
        "<think>a<solution>q</solution>",
        "",
    ],
)
def test_format_refuses(output: str) -> None:
    assert verify_format_and_extract(output) == (False, None, None, None)


def test_format_check_never_raises_on_odd_input() -> None:
    assert verify_format_and_extract(None)[0] is False  # type: ignore[arg-type]
    assert verify_format_and_extract("<solution>" * 100_000)[0] is False


def test_database_and_rows_are_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        local_db.make_database(local_db.database_file(root), seed=3)
    assert digest(a) == digest(b)
    assert local_db.make_text2sql_rows(a, count=20, seed=4) == local_db.make_text2sql_rows(
        b, count=20, seed=4
    )
    with pytest.raises(EnvError, match="make_text2sql_rows.db_root"):
        local_db.make_text2sql_rows(tmp_path / "none", count=1, seed=0)


def test_rows_round_trip_through_parquet_and_are_solvable(db_root: Path, tmp_path: Path) -> None:
    rows = local_db.make_text2sql_rows(db_root, count=40, seed=1)
    file = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), file)
    back = pq.read_table(file).to_pylist()
    assert back == rows
    assert {r["extra_info"]["template"] for r in back} == set(local_db._TEMPLATES)
    for row in back:
        assert len(row["prompt"][0]["content"]) < 300
        assert (row["env_class"], row["data"], row["db_id"]) == ("text2sql", "local", "company")
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        env = skyrl_gym.make("text2sql", env_config={"db_path": str(db_root)}, extras=extras)
        gold = row["reward_spec"]["ground_truth"]
        out = env.step(f"<think>easy</think><solution>{gold}</solution>")
        assert out["reward"] == 1.0, row


def test_prompt_schema_matches_the_database(db_root: Path) -> None:
    db_file = local_db.database_file(db_root)
    for table in ("departments", "employees"):
        result = run_readonly_query(db_file, f"PRAGMA table_info({table})", timeout=5, max_rows=99)
        columns = ", ".join(str(row[1]) for row in result.rows or [])
        assert f"{table}({columns})" in local_db.SCHEMA


def test_script_writes_the_database_and_both_splits(tmp_path: Path, capsys) -> None:
    out, root = tmp_path / "data", tmp_path / "dbs"
    args = ["--out", str(out), "--db-root", str(root), "--train", "12", "--validation", "5"]
    assert make_sql_dataset.main(args) == 0
    assert local_db.database_file(root).is_file()
    train = pq.read_table(out / "train.parquet").to_pylist()
    validation = pq.read_table(out / "validation.parquet").to_pylist()
    assert (len(train), len(validation)) == (12, 5)
    assert train == local_db.make_text2sql_rows(root, count=12, seed=1)
    assert "train: 12 rows" in capsys.readouterr().out
