"""A read-only, time- and size-bounded SQLite query tool (SkyRL's ``sql`` tool).

    group = SQLCodeExecutorToolGroup("/data/sql")    # holds <db_id>/<db_id>.sqlite
    group.execute_tool("sql", "company", "SELECT name FROM employees", 3)

The tool's answer is one ``<observation>`` block: the result rows as text (or the
error, or a note that the reply had no query), then a reminder of the turns left.

Model-written SQL runs in this process, so every query is fenced in four ways:

* read-only: the file is opened with ``mode=ro`` and an authorizer allows only reads
  (SELECT, CTEs, functions, a few schema pragmas); writes, ATTACH and transactions are
  refused, and the refusal is the observation;
* time: a progress handler aborts the query past its deadline (no threads to leak);
* rows: a row factory stops fetching after ``max_rows`` rows;
* size: one string or blob is capped by SQLite's length limit, and the rendered
  observation by ``max_chars``.

``run_readonly_query`` is shared with the text2sql reward, which runs the predicted
and the gold SQL under the same fences.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_gym.error import EnvError, Error
from skyrl_gym.tools.core import ToolGroup, tool

INVALID_ACTION = (
    "Your previous action is invalid. Follow the format of outputting thinking process "
    "and sql tool, and try again."
)
"""SkyRL's text for a reply without a ``<sql>`` query (models trained on it expect it)."""
MAX_VALUE_BYTES = 100_000
"""SQLite's per-value length limit on the tool's connections: one huge string cannot
exhaust memory, and the query fails with 'string or blob too big' instead."""
MAX_CELL_CHARS = 100
"""A value longer than this is cut in the rendered table."""
DEFAULT_TIMEOUT = 5.0
"""Seconds one tool query may run (SkyRL's)."""
PROGRESS_EVERY = 1_000
"""SQLite virtual-machine steps between deadline checks (microseconds apart)."""
_DB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_READ_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"}
)
_ALLOWED = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


class _RowCap(Error):
    """Raised by the row factory once enough rows are held; never leaves this module."""


@dataclass(frozen=True)
class QueryResult:
    """One query's outcome: rows (None on failure), column names, and why it stopped."""

    rows: list[tuple[Any, ...]] | None
    columns: list[str]
    error: str | None = None
    truncated: bool = False
    """More rows existed than ``max_rows``; ``rows`` holds the first ``max_rows``."""
    timed_out: bool = False
    refused: bool = False
    """The authorizer refused a statement that is not a read."""


def _authorize(denied: list[bool]) -> Any:
    def check(action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
        if action in _ALLOWED:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:
            return sqlite3.SQLITE_OK
        denied[0] = True
        return sqlite3.SQLITE_DENY

    return check


def run_readonly_query(
    db_file: str | os.PathLike[str], sql: str, *, timeout: float, max_rows: int
) -> QueryResult:
    """Run one statement on ``db_file`` read-only; never raises for a bad query.

    One connection per call, opened as ``sqlite3.connect(<uri>, uri=True)`` and always
    closed. Rows come from ``cursor.fetchall()`` (the row factory stops it at
    ``max_rows + 1`` rows, so ``truncated`` is exact)."""
    uri = Path(os.path.abspath(db_file)).as_uri() + "?mode=ro"
    deadline = time.monotonic() + timeout
    stopped, denied = [False], [False]
    held: list[tuple[Any, ...]] = []

    def past_deadline() -> bool:
        stopped[0] = time.monotonic() > deadline
        return stopped[0]

    def keep(cursor: Any, row: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(held) > max_rows:
            raise _RowCap
        held.append(row)
        return row

    conn = None
    try:
        conn = sqlite3.connect(uri, uri=True)
        if hasattr(conn, "setlimit"):  # Python >= 3.11
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.set_authorizer(_authorize(denied))
        conn.set_progress_handler(past_deadline, PROGRESS_EVERY)
        conn.row_factory = keep
        cursor = conn.cursor()
        cursor.execute(sql)
        try:
            rows = list(cursor.fetchall())
        except _RowCap:
            rows = held
        description = cursor.description
        columns = [str(d[0]) for d in description] if isinstance(description, tuple) else []
        return QueryResult(rows[:max_rows], columns, truncated=len(rows) > max_rows)
    except Exception as exc:  # the query's fault, or the file's: reported, never raised
        if stopped[0]:
            return QueryResult(
                None, [], f"query stopped at the {timeout:g} s time limit", timed_out=True
            )
        if denied[0]:
            return QueryResult(
                None, [], f"only read-only queries are allowed ({exc})", refused=True
            )
        return QueryResult(None, [], f"{type(exc).__name__}: {exc}")
    finally:
        if conn is not None:
            conn.close()


def _check_timeout(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 600:
        raise EnvError(f"{field}: expected seconds in (0, 600], got {value!r}")
    return float(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    text = str(value).replace("\n", " ")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."


def render_result(result: QueryResult, *, max_chars: int) -> str:
    """The result as lines of ``a | b`` (a header of column names first), at most
    ``max_chars`` characters; what does not fit is cut at a row and said to be."""
    if result.rows is None:
        return f"Error: {result.error}"
    lines = [" | ".join(result.columns)[:max_chars]] if result.columns else []
    if not result.rows:
        return "\n".join([*lines, "(no rows)"])
    shown = 0
    used = sum(len(line) + 1 for line in lines)
    for row in result.rows:
        line = " | ".join(_cell(v) for v in row)
        if shown and used + len(line) + 1 > max_chars:
            break
        lines.append(line[:max_chars])
        used += len(line) + 1
        shown += 1
    if shown < len(result.rows) or result.truncated:
        more = "more" if result.truncated else f"{len(result.rows)} in all"
        lines.append(f"(truncated: {shown} rows shown, {more})")
    return "\n".join(lines)


def check_db_id(field: str, db_id: Any) -> str:
    """``db_id`` when it names a folder inside the root: no path separator, no leading
    dot (``../x`` would open a file outside ``db_file_path``)."""
    if not isinstance(db_id, str) or not _DB_ID.fullmatch(db_id):
        raise EnvError(
            f"{field}: expected letters, digits, '_', '.' or '-' (not starting with '.'), "
            f"got {db_id!r:.80}"
        )
    return db_id


def reminder(turns_left: int) -> str:
    return f"<reminder>You have {turns_left} turns left to complete the task.</reminder>"


class SQLCodeExecutorToolGroup(ToolGroup):
    """The ``sql`` tool over the databases under ``db_file_path`` (one folder per
    ``db_id`` holding ``<db_id>.sqlite``, Spider's layout)."""

    def __init__(
        self,
        db_file_path: str,
        *,
        max_rows: int = 50,
        max_chars: int = 2000,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(db_file_path, (str, os.PathLike)) or not str(db_file_path):
            raise EnvError(
                f"SQLCodeExecutorToolGroup.db_file_path: expected a folder path, got {db_file_path!r}"
            )
        for field, value in (("max_rows", max_rows), ("max_chars", max_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EnvError(
                    f"SQLCodeExecutorToolGroup.{field}: expected an int >= 1, got {value!r}"
                )
        self.timeout = _check_timeout("SQLCodeExecutorToolGroup.timeout", timeout)
        self.db_path = str(db_file_path)
        self.max_rows = max_rows
        self.max_chars = max_chars
        super().__init__(name="SQLCodeExecutorToolGroup")

    def db_file(self, db_id: str) -> str:
        """``<db_file_path>/<db_id>/<db_id>.sqlite``."""
        return os.path.join(
            self.db_path, check_db_id(f"{self.name}.db_id", db_id), f"{db_id}.sqlite"
        )

    @tool
    def sql(
        self, db_id: str, sql: str | None, turns_left: int, timeout: float | None = None
    ) -> str:
        """Run ``sql`` on database ``db_id`` for at most ``timeout`` seconds (None: the
        group's, 5 by default); None for ``sql`` (the reply had no query) gets SkyRL's
        invalid-action message. The observation always ends with the turns left."""
        limit = (
            self.timeout if timeout is None else _check_timeout(f"{self.name}.sql.timeout", timeout)
        )
        if sql is None:
            text = INVALID_ACTION
        elif not isinstance(sql, str):
            raise EnvError(f"{self.name}.sql.sql: expected a str or None, got {sql!r:.80}")
        else:
            result = run_readonly_query(
                self.db_file(db_id), sql, timeout=limit, max_rows=self.max_rows
            )
            text = render_result(result, max_chars=self.max_chars)
        return f"\n\n<observation>{text}\n{reminder(turns_left)}</observation>\n\n"
