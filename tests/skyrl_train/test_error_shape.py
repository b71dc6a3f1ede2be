"""One message shape, built by the constructors: ``where: expected X, got Y``.

The constructors take ``expected=``/``got=`` and write the shape themselves; a source
scan keeps call sites from hand-writing ``"expected ..., got ..."`` again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from skyrl_train.errors import (
    CollationError,
    ConfigValidationError,
    DatasetError,
    RouteReplayError,
    RouteTraceError,
)

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("skyrl_train", "scripts")
PLACED = (CollationError, RouteTraceError, RouteReplayError)

# ------------------------------------------------------------------ constructors


def test_config_error_builds_the_message_from_expected_and_got() -> None:
    err = ConfigValidationError("trainer.epochs", expected="an int >= 1", got="0")
    assert str(err) == "trainer.epochs: expected an int >= 1, got 0"
    assert (err.path, err.reason) == ("trainer.epochs", "expected an int >= 1, got 0")
    assert (err.expected, err.got) == ("an int >= 1", "0")


def test_config_error_keeps_a_free_form_reason_without_expected_and_got() -> None:
    err = ConfigValidationError("environment.kwargs", "unknown keyword 'x'")
    assert str(err) == "environment.kwargs: unknown keyword 'x'"
    assert (err.reason, err.expected, err.got) == ("unknown keyword 'x'", None, None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # neither form
        {"reason": "r", "expected": "e", "got": "g"},  # both forms
        {"reason": "r", "expected": "e"},
        {"expected": "e"},  # half of the keyword form
        {"got": "g"},
    ],
)
def test_config_error_refuses_both_forms_or_neither(kwargs: dict[str, str]) -> None:
    with pytest.raises(TypeError):
        ConfigValidationError("k", **kwargs)


def test_dataset_error_builds_the_message_after_file_row_and_field(tmp_path: Path) -> None:
    file = tmp_path / "rows.jsonl"
    err = DatasetError(
        "data.train_data[0]", file, row=3, field="prompt", expected="a list", got="'hi'"
    )
    assert str(err) == f"data.train_data[0]: {file} row 3: prompt: expected a list, got 'hi'"
    assert (err.path, err.file, err.row, err.field) == ("data.train_data[0]", file, 3, "prompt")
    assert (err.expected, err.got) == ("a list", "'hi'")
    whole = DatasetError("data.val_data[1]", file, row=None, field=None, reason="unreadable")
    assert str(whole) == f"data.val_data[1]: {file}: unreadable"
    assert (whole.expected, whole.got) == (None, None)
    assert isinstance(err, ConfigValidationError)


@pytest.mark.parametrize("kwargs", [{}, {"reason": "r", "expected": "e", "got": "g"}, {"got": "g"}])
def test_dataset_error_refuses_both_forms_or_neither(kwargs: dict[str, str]) -> None:
    with pytest.raises(TypeError):
        DatasetError("data.train_data[0]", "f.jsonl", row=0, field=None, **kwargs)


@pytest.mark.parametrize("cls", PLACED)
def test_placed_errors_build_where_expected_got(cls: type[CollationError]) -> None:
    err = cls("rewards[3]", expected="a finite number", got="nan")
    assert str(err) == "rewards[3]: expected a finite number, got nan"
    assert (err.expected, err.got) == ("a finite number", "nan")
    alone = cls("trajectory t0: a whole message")
    assert str(alone) == "trajectory t0: a whole message"
    assert (alone.expected, alone.got) == (None, None)
    with pytest.raises(TypeError):
        cls("rewards[3]", expected="a finite number")
    with pytest.raises(TypeError):
        cls("rewards[3]", got="nan")


# ------------------------------------------------------------------ source scan


def _literal_text(node: ast.expr) -> str | None:
    """The leading literal text of a string literal or f-string; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return head.value if isinstance(head, ast.Constant) else ""
    return None


def _full_literal(node: ast.expr) -> str | None:
    """A string literal's text, or an f-string's literal parts with fields as ``{}``."""
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return _literal_text(node)


def hand_written_shapes(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of every error call that spells ``expected ..., got ...`` itself:
    a ``ConfigValidationError``/``DatasetError`` reason (positional or ``reason=``)
    starting ``expected ``, or a placed error's message holding ``: expected ``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        reasons: list[ast.expr] = []
        if name == "ConfigValidationError":
            reasons = node.args[1:]
        if name in ("ConfigValidationError", "DatasetError"):
            reasons += [k.value for k in node.keywords if k.arg == "reason"]
            if any((_literal_text(r) or "").startswith("expected ") for r in reasons):
                found.append(f"{filename}:{node.lineno}")
        if name in {cls.__name__ for cls in PLACED} and node.args:
            if ": expected " in (_full_literal(node.args[0]) or ""):
                found.append(f"{filename}:{node.lineno}")
    return found


def test_the_scan_finds_every_hand_written_spelling() -> None:
    source = """
ConfigValidationError(key, f"expected {x}, got {y}")
ConfigValidationError(key, reason="expected a, got b")
ConfigValidationError(
    key,
    f"expected a divisor of {n} "
    f"got {m}",
)
errors.ConfigValidationError(key, "expected a, got b")
DatasetError(key, path, row=0, field=None, reason=f"expected rows, got {n}")
CollationError(f"{field}: expected {n} entries, got {m}")
RouteReplayError(f"trajectory_ids: expected {batch} ids, got {len(names)}")
"""
    assert len(hand_written_shapes(source)) == 7
    clean = """
ConfigValidationError(key, expected=f"a divisor of {n}", got=str(m))
ConfigValidationError(key, "routing replay needs the rollout's routes")
ConfigValidationError(key, str(exc))
DatasetError(key, path, row=0, field=None, expected="rows", got="none")
CollationError(field, expected=f"{n} entries", got=str(m))
RouteTraceError(f"trajectory {tid}: a message that states no expectation")
"""
    assert hand_written_shapes(clean) == []


def test_no_call_site_hand_writes_expected_got() -> None:
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            found += hand_written_shapes(path.read_text(encoding="utf-8"), name)
    assert found == [], "pass expected=/got= to the error's constructor instead"
