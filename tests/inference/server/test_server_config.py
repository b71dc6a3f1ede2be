"""``ServerConfig``: off loopback a token is required; the new limits are checked."""

from __future__ import annotations

import pytest

from inference.server import ServerConfig
from inference.server.__main__ import parse_args


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_hosts_need_no_token(host: str) -> None:
    assert ServerConfig(host=host).api_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "example.org"])
def test_other_hosts_refuse_to_start_without_a_token(host: str) -> None:
    with pytest.raises(ValueError) as info:
        ServerConfig(host=host)
    assert str(info.value) == (
        f"ServerConfig.api_key: expected a token for host {host!r} (not loopback: "
        "127.0.0.0/8, ::1, localhost), got None"
    )
    assert ServerConfig(host=host, api_key="secret").host == host


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keepalive_timeout_s": 0}, "keepalive_timeout_s"),
        ({"request_read_timeout_s": -1.0}, "request_read_timeout_s"),
        ({"request_read_timeout_s": float("nan")}, "request_read_timeout_s"),
        ({"weight_read_timeout_s": float("inf")}, "weight_read_timeout_s"),
        ({"keepalive_timeout_s": True}, "keepalive_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_bad_limits_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"ServerConfig.{field}: expected"):
        ServerConfig(**kwargs)


def test_defaults() -> None:
    config = ServerConfig()
    assert (config.keepalive_timeout_s, config.request_read_timeout_s) == (30.0, 30.0)
    assert (config.weight_read_timeout_s, config.max_connections) == (600.0, 1024)


def test_cli_refuses_a_public_host_without_api_key_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--host", "0.0.0.0"])
    assert info.value.code == 2
    assert "ServerConfig.api_key: expected a token for host '0.0.0.0'" in capsys.readouterr().err
    monkeypatch.setenv("R3_TEST_KEY", "k")
    _, config = parse_args(["--host", "0.0.0.0", "--api-key-env", "R3_TEST_KEY"])
    assert config.host == "0.0.0.0" and config.api_key == "k"


def test_cli_maps_the_connection_limits() -> None:
    _, config = parse_args(
        ["--keepalive-timeout-s", "5", "--request-read-timeout-s", "2.5",
         "--weight-read-timeout-s", "60", "--max-connections", "32"]
    )  # fmt: skip
    assert config.keepalive_timeout_s == 5.0 and config.request_read_timeout_s == 2.5
    assert config.weight_read_timeout_s == 60.0 and config.max_connections == 32
