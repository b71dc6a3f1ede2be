"""``python -m inference.server`` binds, prints its URL, serves, and exits on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from inference.client import RemoteGenerateClient
from inference.server import EngineSpec
from inference.server.__main__ import parse_args

REPO = Path(__file__).resolve().parents[3]


def _model_args(kind: str, checkpoints: dict[str, Path]) -> list[str]:
    if kind == "checkpoint":
        # Qwen3-MoE, 3 layers with a dense first one: 2 route layers.
        return ["--checkpoint", str(checkpoints["qwen3_moe"])]
    return ["--model-seed", "0", "--tiny-moe-json", '{"num_layers": 2}']


@pytest.mark.parametrize("kind", ["checkpoint", "random-init"])
def test_cli_prints_url_serves_and_stops_on_sigterm(kind: str, tiny_checkpoints) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "R3_TEST_KEY": "cli-token",
    }
    process = subprocess.Popen(
        [
            sys.executable, "-m", "inference.server",
            "--host", "127.0.0.1", "--port", "0", "--api-key-env", "R3_TEST_KEY",
            "--max-sample-support-k", "300",
            *_model_args(kind, tiny_checkpoints),
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline().strip()
        assert first.startswith("serving http://127.0.0.1:"), (
            process.stderr.read() if process.stderr else first
        )
        url = first.removeprefix("serving ")

        async def main():
            async with RemoteGenerateClient(url, api_key="cli-token") as client:
                routed = await client.generate(
                    prompt_token_ids=[10, 20, 30],
                    sampling_params={"max_tokens": 2, "temperature": 0.0},
                    return_routed_experts=True,
                )
                # Wider than the default cap of 64: refused without the flag.
                wide = await client.generate(
                    prompt_token_ids=[10, 20, 30],
                    sampling_params={"max_tokens": 2, "top_p": 0.999},
                    return_sample_support=200,
                )
                return routed, wide, await client.health()

        result, wide, health = asyncio.run(main())
        assert result.routed_experts.shape[1] == 2  # the model arguments reached the engine
        assert wide.sample_support_ids.shape == (2, 200)
        assert health["limits"]["max_sample_support_k"] == 300
        assert health["limits"]["default_sample_support_k"] == 8
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert process.stdout.readline().strip() == "stopped"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tiny-moe-json", "[1]"], "--tiny-moe-json: expected a JSON object"),
        (["--tiny-moe-json", "{oops"], "--tiny-moe-json: expected a JSON object"),
        (["--api-key-env", "R3_SURELY_UNSET_VAR"], "--api-key-env: expected a set"),
        (["--checkpoint", "/surely/not/a/folder"], "folder: expected an existing checkpoint"),
        (
            ["--checkpoint", "/surely/not/a/folder", "--tiny-moe-json", "{}"],
            "--tiny-moe-json: expected no overrides with --checkpoint",
        ),
    ],
)
def test_cli_refuses_bad_arguments(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("R3_SURELY_UNSET_VAR", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_cli_arguments_map_to_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R3_TEST_KEY", "k")
    engine, server = parse_args(
        ["--port", "0", "--model-seed", "3", "--dtype", "float32", "--api-key-env", "R3_TEST_KEY",
         "--tiny-moe-json", '{"num_experts": 4}', "--max-new-tokens", "16"]
    )  # fmt: skip
    assert engine == EngineSpec(tiny_moe={"num_experts": 4}, seed=3, dtype="float32")
    assert server.host == "127.0.0.1" and server.port == 0 and server.api_key == "k"
    assert server.max_new_tokens == 16
    # Batch-invariant generation by default; --no-batch-invariant runs the stock forward.
    assert engine.batch_invariant is True
    assert parse_args(["--no-batch-invariant"])[0].batch_invariant is False


def test_cli_sample_support_cap_defaults_to_64_and_has_a_flag() -> None:
    _, server = parse_args([])
    assert (server.max_sample_support_k, server.default_sample_support_k) == (64, 8)
    _, server = parse_args(["--max-sample-support-k", "512"])
    assert (server.max_sample_support_k, server.default_sample_support_k) == (512, 8)
    # A cap below the default k lowers the default (it has no flag of its own).
    _, server = parse_args(["--max-sample-support-k", "4"])
    assert (server.max_sample_support_k, server.default_sample_support_k) == (4, 4)


def test_cli_refuses_a_sample_support_cap_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--max-sample-support-k", "0"])
    assert info.value.code == 2
    assert "max_sample_support_k: expected an int >= 1, got 0" in capsys.readouterr().err


def test_cli_checkpoint_maps_to_the_spec(tiny_checkpoints) -> None:
    folder = str(tiny_checkpoints["mixtral"])
    engine, _ = parse_args(["--checkpoint", folder, "--model-name", "mixtral-tiny"])
    assert engine == EngineSpec(checkpoint=folder, model_name="mixtral-tiny")
    assert engine.tiny_moe == {}
