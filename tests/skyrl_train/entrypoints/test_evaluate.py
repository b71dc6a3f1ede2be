"""The evaluation command without Ray: its launch (``evaluate.run``) with the servers
replaced by a scripted engine that answers row i right in a fixed number of its
samples, so every figure of ``eval.json`` can be worked out by hand; rows whose
environment raises are reported by file and row while the others are scored.
(A real run with servers: test_evaluate_e2e.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import skyrl_gym
from inference.models.tokenizer import build_byte_tokenizer
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import PPOConfig
from skyrl_train.config.validate import validate_cfg
from skyrl_train.entrypoints import evaluate as evaluate_module
from skyrl_train.errors import ConfigValidationError, DatasetError
from skyrl_train.trainer import engine_clients

QUIZ = "eval_test_quiz"
N = 4
CORRECT = [0, 1, 2, 3, 4, 0, 1, 1, 2, 4, 4, 3]
"""Row i's engine replies are right in its first CORRECT[i] of N samples."""
SOURCE = ["alpha"] * 6 + ["beta"] * 6

# pass@k of one row of N = 4 samples with c right, 1 - C(4 - c, k) / C(4, k), by hand:
# k=1: c/4; k=2: c=0 -> 0, 1 -> 1 - 3/6, 2 -> 1 - 1/6, 3 and 4 -> 1; k=4: 1 once c > 0.
# alpha's c = 0 1 2 3 4 0, beta's c = 1 1 2 4 4 3; a right reply earns 1, a wrong one 0.25.
EXPECTED = {
    "alpha": {
        "pass@1": Fraction(0 + 1 + 2 + 3 + 4 + 0, 24),
        "pass@2": (0 + Fraction(1, 2) + Fraction(5, 6) + 1 + 1 + 0) / 6,
        "pass@4": Fraction(4, 6),
        "reward_mean": (10 * 1 + 14 * Fraction(1, 4)) / 24,
    },
    "beta": {
        "pass@1": Fraction(1 + 1 + 2 + 4 + 4 + 3, 24),
        "pass@2": (Fraction(1, 2) + Fraction(1, 2) + Fraction(5, 6) + 1 + 1 + 1) / 6,
        "pass@4": Fraction(1),
        "reward_mean": (15 * 1 + 9 * Fraction(1, 4)) / 24,
    },
    "overall": {
        "pass@1": Fraction(25, 48),
        "pass@2": Fraction(49, 72),
        "pass@4": Fraction(10, 12),
        "reward_mean": (25 * 1 + 23 * Fraction(1, 4)) / 48,
    },
}


class QuizEnv(BaseTextEnv):
    """One turn: the reply must be the row's ground truth. ``extra_info.fail`` makes
    the environment raise while built, in init or in step."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.answer = str(extras["reward_spec"]["ground_truth"])
        self.fail = (extras.get("extra_info") or {}).get("fail")
        if self.fail == "make":
            raise skyrl_gym.EnvError(f"{QUIZ}.extra_info: expected no fail, got {self.fail!r}")

    def init(self, prompt: list[dict[str, str]]) -> Any:
        if self.fail == "init":
            raise RuntimeError("the quiz lost its question")
        return super().init(prompt)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.fail == "step":
            raise KeyError("no answer key")
        solved = action.strip() == self.answer
        reward = 1.0 if solved else 0.25
        return {"observations": [], "reward": reward, "done": True, "metadata": {"solved": solved}}


@pytest.fixture(autouse=True)
def _quiz_env() -> Iterator[None]:
    skyrl_gym.register(QUIZ, QuizEnv)
    yield
    skyrl_gym.deregister(QUIZ)


class QuizEngine:
    """A client stub: the first ``right[q]`` requests about question q get its answer,
    later ones a wrong reply (all of a row's samples go to one server). Records every
    request's question and seed."""

    supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")

    def __init__(self, right: dict[int, int]) -> None:
        self.tokenizer = build_byte_tokenizer()
        self.right = right
        self.asked: Counter[int] = Counter()
        self.requests: list[tuple[int, int]] = []
        self.closed = False

    async def generate(self, *, prompt_token_ids: list[int], sampling_params: Any, **_: Any) -> Any:
        question = int(re.findall(r"q(\d+)", self.tokenizer.decode(prompt_token_ids))[-1])
        self.requests.append((question, sampling_params["seed"]))
        self.asked[question] += 1
        reply = f"x{question}" if self.asked[question] <= self.right[question] else "no"
        await asyncio.sleep(0)  # let other rows' requests interleave
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        return SimpleNamespace(
            response_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", routed_experts=None
        )

    async def close(self) -> None:
        self.closed = True


def rows_file(path: Path, questions: list[int], **extra: dict[str, Any]) -> Path:
    """Quiz rows, one per question; ``extra["q<i>"]`` becomes that row's extra_info."""
    with path.open("w") as fh:
        for q in questions:
            row = {
                "prompt": [{"role": "user", "content": f"q{q}"}],
                "env_class": QUIZ,
                "reward_spec": {"method": "exact", "ground_truth": f"x{q}"},
                "data_source": SOURCE[q % 12],
                "extra_info": extra.get(f"q{q}", {}),
            }
            fh.write(json.dumps(row) + "\n")
    return path


def config(tmp_path: Path, files: list[Path], *overrides: str) -> PPOConfig:
    return load_config(
        [
            f"data.val_data=[{','.join(map(str, files))}]",
            f"generator.eval_n_samples_per_prompt={N}",
            "generator.eval_sampling_params.temperature=1.0",
            "generator.max_turns=1",
            "generator.max_tokens_per_turn=4",
            "logging.progress_bar=false",
            f"trainer.run_dir={tmp_path / 'eval'}",
            *overrides,
        ]
    )


URLS = ["http://quiz-0.invalid", "http://quiz-1.invalid"]


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[QuizEngine]:
    """The command's two servers replaced by ``QuizEngine``s (and no Ray)."""
    stubs = [QuizEngine({q: CORRECT[q % 12] for q in range(40)}) for _ in URLS]

    @contextlib.contextmanager
    def serving(cfg: PPOConfig, checkpoint: Path, **_: Any) -> Iterator[Any]:
        yield SimpleNamespace(urls=URLS, api_key=None)

    monkeypatch.setattr(evaluate_module, "serving", serving)
    monkeypatch.setattr(engine_clients, "make_client", lambda url, _: stubs[URLS.index(url)])
    return stubs


def requests(engines: list[QuizEngine]) -> list[tuple[int, int]]:
    return sorted(r for engine in engines for r in engine.requests)


def check_figures(figures: dict[str, Any], expected: dict[str, Fraction], rows: int) -> None:
    assert figures["rows"] == rows and figures["samples"] == rows * N
    for key, value in expected.items():
        assert figures[key] == pytest.approx(float(value), abs=1e-12), key
    # The environment reports solved on every sample: success is pass@1.
    assert figures["success_rate"] == pytest.approx(float(expected["pass@1"]), abs=1e-12)
    assert figures["correct_if"] == "solved"


def test_eval_json_holds_hand_computed_pass_at_k(tmp_path: Path, engines: list[QuizEngine]) -> None:
    data = rows_file(tmp_path / "quiz.jsonl", list(range(12)))
    report = evaluate_module.run(config(tmp_path, [data]))
    written = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert written["ks"] == [1, 2, 4] and written["n_samples_per_prompt"] == N
    assert written["failed_rows"] == []
    check_figures(written["overall"], EXPECTED["overall"], rows=12)
    assert sorted(written["by_data_source"]) == ["alpha", "beta"]
    for source in ("alpha", "beta"):
        check_figures(written["by_data_source"][source], EXPECTED[source], rows=6)
    overall = written["overall"]
    # Replies are 2 bytes ("x7", "no") but the right ones of q10 (4) and q11 (3).
    assert overall["response_length_mean"] == pytest.approx((48 * 2 + 7) / 48)
    assert overall["generated_tokens_mean"] == overall["response_length_mean"]
    assert written["eval_sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    # Every row sampled N times, every request with a seed of its own, on one server:
    # the rows alternate between the two.
    assert Counter(q for q, _ in requests(engines)) == {q: N for q in range(12)}
    assert len({seed for _, seed in requests(engines)}) == 12 * N
    for i, engine in enumerate(engines):
        assert {q for q, _ in engine.requests} == set(range(i, 12, 2))
        assert engine.closed
    log = (tmp_path / "eval" / "evaluate.log").read_text()
    assert "eval.json: 12 rows x 4 samples, 0 failed" in log


def test_rows_whose_environment_fails_are_reported_and_the_rest_scored(
    tmp_path: Path, engines: list[QuizEngine], caplog: pytest.LogCaptureFixture
) -> None:
    # The 12 rows over two files, with a row failing in each stage among them: q12
    # refuses to be built, q13 fails in init (both alpha), q18 (beta) in step.
    first = rows_file(
        tmp_path / "first.jsonl",
        [0, 1, 2, 12, 3, 4, 5, 13],
        q12={"fail": "make"},
        q13={"fail": "init"},
    )
    second = rows_file(tmp_path / "second.jsonl", [6, 18, 7, 8, 9, 10, 11], q18={"fail": "step"})
    with caplog.at_level(logging.WARNING):
        written = evaluate_module.run(config(tmp_path, [first, second]))
    failed = written["failed_rows"]
    assert [(f["key"], f["file"], f["row"], f["stage"], f["data_source"]) for f in failed] == [
        ("data.val_data[0]", str(first), 3, "make", "alpha"),
        ("data.val_data[0]", str(first), 7, "init", "alpha"),
        ("data.val_data[1]", str(second), 1, "step", "beta"),
    ]
    assert failed[0]["error"].startswith("EnvError: eval_test_quiz.extra_info: expected no fail")
    assert failed[1]["error"] == "RuntimeError: the quiz lost its question"
    assert failed[2]["error"] == "KeyError: 'no answer key'"
    # Each failure is in the log too, by file and row.
    for f in failed:
        where = f"{f['file']} row {f['row']}: environment 'eval_test_quiz' raised in {f['stage']}"
        assert any(where in message for message in caplog.messages), where
    # The other twelve rows score exactly as without the failing ones.
    check_figures(written["overall"], EXPECTED["overall"], rows=12)
    assert written["overall"]["failed_rows"] == 3
    for source, failures in (("alpha", 2), ("beta", 1)):
        figures = written["by_data_source"][source]
        check_figures(figures, EXPECTED[source], rows=6)
        assert figures["failed_rows"] == failures
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == written


def test_seeds_do_not_depend_on_how_many_rows_run_at_once(
    tmp_path: Path, engines: list[QuizEngine]
) -> None:
    data = rows_file(tmp_path / "quiz.jsonl", list(range(12)))
    seen = []
    for width in (N, 64):  # one row at a time, then all twelve at once
        for engine in engines:
            engine.requests.clear()
            engine.asked.clear()
        cfg = config(tmp_path, [data], f"generator.max_concurrent_trajectories={width}")
        evaluate_module.run(cfg)
        seen.append(requests(engines))
    assert seen[0] == seen[1]


def test_data_whose_every_row_fails_is_refused_before_anything_starts(
    tmp_path: Path, engines: list[QuizEngine]
) -> None:
    data = rows_file(tmp_path / "quiz.jsonl", [0, 1], q0={"fail": "make"}, q1={"fail": "make"})
    with pytest.raises(DatasetError) as info:
        evaluate_module.run(config(tmp_path, [data]))
    assert (info.value.path, info.value.row) == ("data.val_data[0]", 0)
    assert "none of 2" in str(info.value)
    assert not (tmp_path / "eval").exists() and requests(engines) == []


def test_a_training_run_folder_is_accepted_and_resume_from_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    cfg = load_config([f"trainer.run_dir={run_dir}"])
    with pytest.raises(ConfigValidationError, match=r"^trainer\.run_dir: "):
        validate_cfg(cfg)  # training refuses another run's folder
    validate_cfg(cfg, evaluation=True)
    cfg = load_config([f"trainer.run_dir={run_dir}", "trainer.resume_from=latest"])
    with pytest.raises(ConfigValidationError, match=r"^trainer\.resume_from: expected null"):
        validate_cfg(cfg, evaluation=True)


def test_greedy_evaluation_is_not_held_to_training_sampling_rules(
    tmp_path: Path, engines: list[QuizEngine]
) -> None:
    # Each of these refuses a training launch (sampler replay's rules); greedy with an
    # explicit trainer temperature is what a training config's evaluation often carries.
    data = rows_file(tmp_path / "quiz.jsonl", [0, 1, 2])
    cfg = config(
        tmp_path,
        [data],
        "generator.sampling_params.temperature=0",
        "generator.eval_sampling_params.temperature=0",
        "generator.eval_n_samples_per_prompt=1",
        "trainer.algorithm.temperature=0.5",
    )
    with pytest.raises(ConfigValidationError, match=r"^generator\.sampling_params\.temperature"):
        validate_cfg(cfg)
    report = evaluate_module.run(cfg)
    assert report["eval_sampling_params"]["temperature"] == 0.0
    assert report["overall"]["rows"] == 3 and report["n_samples_per_prompt"] == 1
    assert (tmp_path / "eval" / "eval.json").is_file()
