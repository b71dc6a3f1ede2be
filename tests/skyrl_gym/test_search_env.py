"""search against a real local retrieval server: passages in the observation, exact-match
scoring, a failing server as an observation (never an exception), setting and row
checks, the in-process ``local`` mode and the demo dataset."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.search import demo
from skyrl_gym.envs.search.env import MissingGroundTruthError
from skyrl_gym.envs.search.local_retriever import BM25Index, serve_retriever
from skyrl_gym.envs.search.utils import em_check, extract_solution, normalize_answer
from skyrl_gym.tools.search import SearchSession, SearchToolGroup, call_search_api

ITALY = {"reward_spec": {"method": "rule", "ground_truth": {"target": "Rome"}}, "max_turns": 3}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with serve_retriever(demo.DEMO_CORPUS) as server:
        yield server.url


def make_env(url: str, extras: dict[str, Any] = ITALY, **settings: Any) -> Any:
    return skyrl_gym.make("search", env_config={"search_url": url, **settings}, extras=extras)


def information(out: dict[str, Any]) -> str:
    assert out["done"] is False and out["reward"] == 0.0
    (message,) = out["observations"]
    assert message["role"] == "user"
    content = message["content"]
    assert content.startswith("\n<information>") and content.endswith("</information>\n")
    return content[len("\n<information>") : -len("</information>\n")]


def test_a_search_turn_shows_the_passages(server_url: str) -> None:
    env = make_env(server_url, topk=2)
    out = env.step("<think>look it up</think><search> capital city of Italy </search>")
    result = json.loads(information(out))["result"]
    assert result.startswith('Doc 1: "Rome"\nRome is the capital city of Italy')
    assert "Doc 2: " in result and "Doc 3: " not in result
    assert out["metadata"]["tool_input"] == [" capital city of Italy "]
    assert [m["role"] for m in env.chat_history] == ["assistant", "user"]


@pytest.mark.parametrize(
    ("answer", "target", "reward"),
    [
        ("Rome", "Rome", 1.0),
        ("  the ROME! ", "Rome", 1.0),
        ("Milan", "Rome", 0.0),
        ("Ulan Bator", ["Ulaanbaatar", "Ulan Bator"], 1.0),
        ("Beijing", ["Ulaanbaatar", "Ulan Bator"], 0.0),
    ],
)
def test_the_answer_is_scored_by_exact_match(
    server_url: str, answer: str, target: Any, reward: float
) -> None:
    extras = {"reward_spec": {"ground_truth": {"target": target}}, "max_turns": 3}
    env = make_env(server_url, extras)
    information(env.step("<search>capital of Italy</search>"))
    out = env.step(f"<think>found it</think><answer>{answer}</answer>")
    assert (out["done"], out["reward"], out["observations"]) == (True, reward, [])
    assert out["metadata"]["solved"] is (reward == 1.0)


def test_running_out_of_turns_scores_zero_and_a_finished_episode_refuses_steps(
    server_url: str,
) -> None:
    env = make_env(server_url, {**ITALY, "max_turns": 2})
    assert information(env.step("no tags at all")) == ""  # an empty <information>
    out = env.step("<search>still looking</search>")
    assert (out["done"], out["reward"]) == (True, 0.0)
    with pytest.raises(EnvError, match="search.step"):
        env.step("<answer>Rome</answer>")


class _Stub(BaseHTTPRequestHandler):
    """Answers by path: /slow sleeps, /garbage is not JSON, /busy is 503, /shape is
    JSON of the wrong shape, anything else 404."""

    calls: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        self.calls.append(self.path)
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/slow":
            time.sleep(1.0)
        status, body = {
            "/garbage": (200, b"<html>not json</html>"),
            "/busy": (503, b"busy"),
            "/shape": (200, b'{"result": "not a list"}'),
            "/slow": (200, b"{}"),
        }.get(self.path, (404, b"no such route"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/slow", "Timeout Error"),
        ("/garbage", "JSON Decode Error"),
        ("/busy", "Server Error (503) (attempt 2/2)"),
        ("/missing", "HTTP Error 404"),
        ("/shape", "ValueError: expected 'result'"),
    ],
)
def test_a_failing_server_becomes_an_error_observation(
    stub_url: str, path: str, error: str
) -> None:
    env = make_env(stub_url + path, timeout=0.2, retries=1)
    _Stub.calls.clear()
    result = json.loads(information(env.step("<search>anything</search>")))["result"]
    assert result.startswith("Search error: ") and error in result
    retried = path in ("/slow", "/busy")
    assert _Stub.calls == [path] * (2 if retried else 1)


def test_a_server_that_is_down_becomes_an_error_observation() -> None:
    env = make_env(f"http://127.0.0.1:{_closed_port()}/retrieve", retries=0)
    result = json.loads(information(env.step("<search>anything</search>")))["result"]
    assert result.startswith("Search error: Connection Error")
    response, error = call_search_api("not a url", "q", session=SearchSession(retries=0))
    assert response is None and error is not None and "Request Error" in error


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("search_url", "ftp://example.com/retrieve"),
        ("search_url", "127.0.0.1:8000"),
        ("topk", 0),
        ("topk", "3"),
        ("timeout", 0),
        ("retries", 21),
        ("log_requests", "yes"),
        ("corpus_path", "corpus.jsonl"),  # only with search_url 'local'
        ("top_k", 3),  # misspelt
    ],
)
def test_bad_settings_raise_naming_the_setting(key: str, value: Any) -> None:
    settings = {"search_url": "http://127.0.0.1:1/retrieve", key: value}
    with pytest.raises(EnvError) as caught:
        skyrl_gym.make("search", env_config=settings, extras=ITALY)
    message = str(caught.value)
    if key == "top_k":  # an unknown setting: the list of known ones, and the stray key
        assert message.startswith("environment.skyrl_gym.search: ") and "['top_k']" in message
    else:
        assert message.startswith(f"environment.skyrl_gym.search.{key}: "), message


@pytest.mark.parametrize(
    ("extras", "field"),
    [
        ({"max_turns": 3}, "search.extras.reward_spec: "),
        ({"reward_spec": {"method": "rule"}}, "search.extras.reward_spec.ground_truth: "),
        ({"reward_spec": {"ground_truth": "Rome"}}, "reward_spec.ground_truth.target: "),
        ({"reward_spec": {"ground_truth": {"target": []}}}, "reward_spec.ground_truth.target: "),
        ({"reward_spec": {"ground_truth": {"target": [1]}}}, "reward_spec.ground_truth.target: "),
        ({"reward_spec": {"ground_truth": {"target": 5}}}, "reward_spec.ground_truth.target: "),
    ],
)
def test_a_row_without_ground_truth_raises_naming_the_field(
    extras: dict[str, Any], field: str
) -> None:
    with pytest.raises(MissingGroundTruthError, match=field) as caught:
        skyrl_gym.make("search", env_config=None, extras=extras)
    assert isinstance(caught.value, EnvError) and isinstance(caught.value, AssertionError)
    with pytest.raises(EnvError, match="search.extras.max_turns"):
        skyrl_gym.make("search", extras={**ITALY, "max_turns": 0})


def test_local_mode_searches_in_process(tmp_path: Path) -> None:
    env = make_env("local")  # the demo corpus
    assert "Rome is the capital" in information(env.step("<search>capital of Italy</search>"))
    corpus = tmp_path / "corpus.jsonl"
    demo.write_corpus([{"id": "a", "contents": "Zorblax is the moon of Quuxon."}], corpus)
    env = make_env("local", corpus_path=str(corpus))
    assert "Zorblax" in information(env.step("<search>moon of Quuxon</search>"))
    assert "No search results found." in information(env.step("<search>Italy</search>"))
    corpus.write_text('{"id": "a"}\n')
    with pytest.raises(EnvError, match=r"search\.corpus_path: .*corpus\.jsonl\[0\]"):
        make_env("local", corpus_path=str(corpus))
    with pytest.raises(EnvError, match="SearchToolGroup.retriever"):
        SearchToolGroup("local")


def test_every_demo_question_is_answered_by_its_top_passage() -> None:
    index = BM25Index(demo.DEMO_CORPUS)
    rows = demo.make_search_rows(split="test", max_turns=3)
    assert len(rows) == len(demo.DEMO_QUESTIONS) >= 10
    for row in rows:
        assert row["env_class"] == "search" and row["extra_info"]["split"] == "test"
        question = row["extra_info"]["question"]
        targets = row["reward_spec"]["ground_truth"]["target"]
        (top,) = index.search(question, 1)
        assert any(normalize_answer(t) in normalize_answer(top[0]["contents"]) for t in targets)
        env = skyrl_gym.make("search", env_config={"search_url": "local"}, extras=row)
        assert env.step(f"<answer>{targets[0]}</answer>")["reward"] == 1.0


def test_the_server_speaks_the_batch_form_and_refuses_bad_requests(server_url: str) -> None:
    def post(body: bytes) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(server_url, data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, payload = post(json.dumps({"queries": ["Jupiter", "helium"], "topk": 1}).encode())
    assert status == 200 and [len(hits) for hits in payload["result"]] == [1, 1]
    assert "Jupiter" in payload["result"][0][0]["contents"]  # no scores asked: bare documents
    assert post(b"not json")[0] == 400
    assert post(json.dumps({"query": 5}).encode())[0] == 400


def test_answer_parsing_and_matching() -> None:
    assert extract_solution("<answer>a</answer> then <answer> b </answer>") == "b"
    assert extract_solution("<answer>x<answer>y</answer>") == "x<answer>y"  # as a lazy regex
    assert extract_solution("<answer>open") is None
    started = time.perf_counter()
    assert extract_solution("<answer>" * 200_000) is None
    assert time.perf_counter() - started < 1.0
    assert em_check("An Eiffel tower.", ["the eiffel tower"]) == 1
    assert em_check("Eiffel", "Eiffel Tower") == 0
