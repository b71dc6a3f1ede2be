"""Refused at launch, before Ray, what every request would be refused for after it
(issue 38): a top_k above the model's vocabulary (training and evaluation sampling), and
a cut wider than a remote builtin server's kept-set cap, read from its ``/health``. And
the evaluation command is not held to training's sampling rules."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.server import EngineSpec, ServerConfig, ServerThread
from skyrl_train.config import load_config, validate_cfg
from skyrl_train.errors import ConfigValidationError

SP = "generator.sampling_params"
ESP = "generator.eval_sampling_params"
URLS = "generator.inference_engine.remote_urls"
BUILTIN_VOCAB = 264
"""The built-in model's vocabulary (bytes and its special tokens)."""


def _refusal(overrides: list[str], *, evaluation: bool = False) -> ConfigValidationError:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(overrides), evaluation=evaluation)
    assert str(info.value).startswith(info.value.path + ": ")
    return info.value


# ------------------------------------------------------------------ top_k and the vocabulary


@pytest.mark.parametrize("prefix", [SP, ESP])
def test_a_top_k_above_the_vocabulary_is_refused_naming_the_key(prefix: str) -> None:
    overrides = [f"{prefix}.top_k=300", "generator.max_sample_support_k=512"]
    for evaluation in (False, True):
        err = _refusal(overrides, evaluation=evaluation)
        assert err.path == f"{prefix}.top_k"
        assert f"<= {BUILTIN_VOCAB}" in str(err) and str(err).endswith("got 300")
    validate_cfg(load_config([f"{prefix}.top_k={BUILTIN_VOCAB}"]))  # the whole vocabulary


def test_a_checkpoint_folder_vocabulary_bounds_top_k(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe", seed=0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    err = _refusal([f"model.path={folder}", f"{ESP}.top_k={vocab + 1}"])
    assert err.path == f"{ESP}.top_k" and f"<= {vocab}" in str(err)


# ---------------------------------------------------------------------- evaluation's rules


@pytest.mark.parametrize(
    "overrides",
    [
        [f"{SP}.temperature=0"],
        [f"{ESP}.temperature=0", f"{SP}.temperature=0"],
        ["trainer.algorithm.temperature=0.5"],  # another temperature than the rollout's
        # A cut the vLLM backend cannot report kept sets for: evaluation asks for none.
        [f"{SP}.top_p=0.9", "generator.max_sample_support_k=8"],
    ],
)
def test_evaluation_is_not_held_to_training_sampling_rules(overrides: list[str]) -> None:
    _refusal(overrides)  # training refuses each
    validate_cfg(load_config(overrides), evaluation=True)


# ------------------------------------------------------------- a remote server's support cap


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, str]]:
    """Two builtin servers of the built-in model: the default cap (64) and 300."""
    threads = {
        cap: ServerThread(EngineSpec(seed=0).build, ServerConfig(max_sample_support_k=cap))
        for cap in (64, 300)
    }
    urls = {}
    try:
        for cap, thread in threads.items():
            urls[cap] = thread.start()
        yield urls
    finally:
        for cap in urls:
            threads[cap].stop()


def _remote(url: str, *overrides: str) -> list[str]:
    return [f"{URLS}=[{url}]", *overrides]


def test_a_cut_wider_than_a_remote_servers_cap_is_refused_naming_cap_and_flag(
    servers: dict[int, str],
) -> None:
    # top-p alone asks for the whole vocabulary (264 ids per token) on every request.
    err = _refusal(_remote(servers[64], f"{SP}.top_p=0.9"))
    assert err.path == f"{SP}.top_p"
    assert servers[64] in str(err) and "caps it at 64 ids per token" in str(err)
    assert f"--max-sample-support-k {BUILTIN_VOCAB} or more" in str(err)
    assert str(err).endswith(f"got 0.9, which asks every request for {BUILTIN_VOCAB} ids per token")
    err = _refusal(_remote(servers[64], f"{SP}.top_k=100"))
    assert err.path == f"{SP}.top_k" and "caps it at 64" in str(err)
    # Within the cap, or a server started with the flag raised: accepted.
    validate_cfg(load_config(_remote(servers[64], f"{SP}.top_k=64")))
    validate_cfg(load_config(_remote(servers[300], f"{SP}.top_p=0.9")))
    # Evaluation asks for no kept set; without a cut no server is asked at all.
    validate_cfg(load_config(_remote(servers[64], f"{SP}.top_p=0.9")), evaluation=True)


def test_every_remote_server_is_read_and_the_narrowest_refuses(
    servers: dict[int, str],
) -> None:
    urls = f"[{servers[300]},{servers[64]}]"
    err = _refusal([f"{URLS}={urls}", f"{SP}.top_p=0.9"])
    assert servers[64] in str(err) and f"({URLS}[1])" in str(err)


def test_a_remote_server_that_does_not_answer_is_refused_when_a_cut_needs_its_cap() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    validate_cfg(load_config(_remote(url)))  # no cut: nothing to ask
    err = _refusal(_remote(url, f"{SP}.top_p=0.9"))
    assert err.path == f"{URLS}[0]"
    assert f"to read the kept-set cap that {SP}.top_p=0.9 needs" in str(err)
    assert url in str(err)
