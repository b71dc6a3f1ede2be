"""Rank files load with ``torch.load(weights_only=True)``: a checkpoint handed over by
someone else cannot run code in the trainer, even with a valid manifest; a format-1
file (numpy RNG state pickled) is refused naming the conversion script, which converts
it into a checkpoint that resumes with identical model, optimizer and RNG states."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.errors import CheckpointError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save, verify_checkpoint
from skyrl_train.runs.rank_file import (
    CONVERT_SCRIPT,
    RANK_FORMAT_KEY,
    RANK_FORMAT_VERSION,
    SAVE_KEY,
    RngState,
    checkpoint_file,
    rng_state,
    save_rank_state,
)
from skyrl_train.runs.resume import SavedLayout, load_rank_state, same_layout, saved_layout
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.utils.durable import write_file
from skyrl_train.workers.megatron import MegatronPolicyWorker
from skyrl_train.workers.megatron.placement import parallel_layout
from tests.skyrl_train.runs._state_checks import assert_same_optimizer_state

REPO = Path(__file__).resolve().parents[3]


class RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _commit(root: Path, write_rank: Any, *, step: int = 1) -> Path:
    """A committed one-rank checkpoint whose rank file ``write_rank(path)`` writes: the
    manifest is the project's own, computed over whatever bytes that is."""
    folder = begin_save(root, step=step)
    write_rank(checkpoint_file(folder, 0))
    write_file(folder / DRIVER_FILE, json.dumps({"step": step, "world_size": 1}).encode())
    return commit_save(folder, step=step)


def _format_1_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """A rank state as the trainer wrote it before format 2."""
    return {
        "world_size": 1,
        "layout": {
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            "expert_model_parallel_size": 1,
        },
        "model": model,
        "optimizer": optimizer,
        "torch_rng": torch.random.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------ refusals, no model


def test_a_rank_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    state = {RANK_FORMAT_KEY: RANK_FORMAT_VERSION, "world_size": 1, "x": RunsCode(marker)}
    final = _commit(tmp_path / "ckpts", lambda path: torch.save(state, path))
    verify_checkpoint(final)  # the manifest vouches for these bytes: no protection
    assert not marker.exists()
    with pytest.raises(CheckpointError) as info:
        load_rank_state(final, rank=0, world_size=1)
    path = checkpoint_file(final, 0)
    assert info.value.file == path and str(path) in str(info.value)
    assert info.value.got.startswith("a pickled io.open, which loading would call")
    assert CONVERT_SCRIPT not in str(info.value)
    assert not marker.exists()


def test_a_format_1_rank_file_is_refused_naming_the_conversion_script(tmp_path: Path) -> None:
    import megatron.core  # noqa: F401  (as in the trainer: numpy arrays become safe globals)

    registered = set(torch.serialization.get_safe_globals())
    assert np.ndarray in registered
    state = _format_1_state({"w": torch.ones(3)}, {"state": {}, "param_groups": []})
    final = _commit(tmp_path, lambda path: torch.save(state, path))
    before = _digests(final)
    with pytest.raises(CheckpointError) as info:
        load_rank_state(final, rank=0, world_size=1)
    err = info.value
    assert err.path == "trainer.resume_from" and err.file == checkpoint_file(final, 0)
    assert err.expected.startswith(f"a rank file of format {RANK_FORMAT_VERSION} ")
    assert err.got.startswith(f"a format-1 rank file (no {RANK_FORMAT_KEY}; numpy's RNG state")
    assert f"python {CONVERT_SCRIPT} --checkpoint {final}" in str(err)
    # Resharding reads every rank file through the same reader: the same refusal, not
    # torch's advice to load with weights_only=False.
    with pytest.raises(CheckpointError) as info:
        saved_layout(final)
    assert info.value.got == err.got and "weights_only=False" not in str(info.value)
    assert _digests(final) == before
    assert set(torch.serialization.get_safe_globals()) == registered


@pytest.mark.parametrize("version", [None, 1, 3])
def test_a_rank_file_of_another_format_version_is_refused(tmp_path: Path, version: Any) -> None:
    state = {"world_size": 1} if version is None else {"world_size": 1, RANK_FORMAT_KEY: version}
    torch.save(state, checkpoint_file(tmp_path, 0))
    with pytest.raises(CheckpointError) as info:
        load_rank_state(tmp_path, rank=0, world_size=1)
    assert info.value.expected == f"{RANK_FORMAT_KEY} {RANK_FORMAT_VERSION}"
    assert info.value.got == f"{RANK_FORMAT_KEY} {version!r}"


@pytest.mark.parametrize(
    ("where", "key", "value", "got"),
    [
        (
            "model",
            "fc1._extra_state",
            io.BytesIO(b"fp8"),
            "state['model']['fc1._extra_state']: a _io.BytesIO",
        ),
        # Protocol 2 pickles b"" as a call of builtins.bytes: weights_only refuses it.
        ("model", "fc1._extra_state", b"", "state['model']['fc1._extra_state']: a builtins.bytes"),
        (
            "optimizer",
            "param_groups",
            [{"lr": np.float64(1.0)}],
            "state['optimizer']['param_groups'][0]['lr']: a numpy.float64",
        ),
    ],
)
def test_a_state_only_pickle_could_save_is_refused_before_writing(
    tmp_path: Path, where: str, key: str, value: Any, got: str
) -> None:
    path = checkpoint_file(tmp_path, 0)
    state = {"world_size": 1, where: {"w": torch.ones(2), key: value}}
    with pytest.raises(CheckpointError) as info:
        save_rank_state(path, state)
    assert info.value.path == SAVE_KEY and info.value.file == path
    assert info.value.got == got
    assert not path.exists()


def test_extra_state_none_and_module_metadata_round_trip(tmp_path: Path) -> None:
    # The local Megatron modules leave None in _extra_state; a state_dict's OrderedDict
    # carries _metadata, which load_state_dict reads back.
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model = module.state_dict()
    model["0._extra_state"] = None
    save_rank_state(checkpoint_file(tmp_path, 0), {"world_size": 1, "model": model})
    loaded = load_rank_state(tmp_path, rank=0, world_size=1)["model"]
    assert loaded["0._extra_state"] is None
    assert loaded._metadata == model._metadata  # type: ignore[attr-defined]


# --------------------------------------------------------------- the real worker


def _trainer(tmp_path: Path) -> PolicyTrainer:
    cfg = load_config([f"trainer.run_dir={tmp_path}", "trainer.ref.log_kl=false"])
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    trainer.worker = MegatronPolicyWorker(
        TinyMoEConfig().architecture(),
        cfg.trainer.policy.megatron_config,
        optimizer=OptimizerConfig(lr=1e-2),
    ).setup()
    trainer.info = trainer.worker.rank_info()
    return trainer


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PolicyTrainer, ...]]:
    """(trained, fresh): the first took two AdamW steps, so its weights, moments and
    step count differ from the fresh one's."""
    trained = _trainer(tmp_path_factory.mktemp("trained"))
    model, optimizer = trained.worker.model, trained.worker.optimizer
    assert optimizer is not None
    for _ in range(2):
        optimizer.zero_grad()
        sum((p.float() ** 2).sum() for p in model.parameters()).backward()
        optimizer.step()
    yield trained, _trainer(tmp_path_factory.mktemp("fresh"))


def _seed_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    # Both Gaussian caches filled: the restore must bring them back too.
    np.random.normal()
    random.gauss(0.0, 1.0)


def _draws() -> list[Any]:
    return [
        torch.rand(4).tolist(),
        np.random.normal(),
        np.random.rand(4).tolist(),
        random.gauss(0.0, 1.0),
        random.random(),
    ]


def _perturb(trainer: PolicyTrainer) -> None:
    """Move every weight and optimizer state tensor, so a load that skipped one shows."""
    assert trainer.worker.optimizer is not None
    with torch.no_grad():
        for param in trainer.worker.model.parameters():
            param.add_(1.0)
        for fields in trainer.worker.optimizer.state.values():
            for value in fields.values():
                value.add_(1.0)


def _assert_same_state(trained: PolicyTrainer, fresh: PolicyTrainer) -> None:
    want, got = trained.worker.model.state_dict(), fresh.worker.model.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, got[name]) and value.dtype == got[name].dtype, name
        else:
            assert value == got[name], name
    assert_same_optimizer_state(trained, fresh)


def test_save_and_resume_restore_model_optimizer_and_rng_exactly(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    _seed_rngs(7)
    folder = begin_save(tmp_path, step=1)
    trained.save_checkpoint(str(folder))
    write_file(folder / DRIVER_FILE, json.dumps({"step": 1, "world_size": 1}).encode())
    final = commit_save(folder, step=1)
    expected = _draws()

    raw = torch.load(checkpoint_file(final, 0), weights_only=True)
    assert raw[RANK_FORMAT_KEY] == RANK_FORMAT_VERSION
    _perturb(fresh)
    _seed_rngs(1234)
    fresh.load_checkpoint(str(final))
    assert _draws() == expected
    _assert_same_state(trained, fresh)


def _wrong_shape(state: dict[str, Any], where: str) -> str:
    """Give one tensor of ``state`` another shape; the entry's name, as refused."""
    if where == "model":
        # The last tensor: torch's loader copied every other one first.
        key = [k for k, v in state["model"].items() if isinstance(v, torch.Tensor)][-1]
        state["model"][key] = torch.zeros(3, 5)
        return f"model[{key!r}]"
    last = max(state["optimizer"]["state"])
    state["optimizer"]["state"][last]["exp_avg"] = torch.zeros(3, 5)
    return f"optimizer['state'][{last}]['exp_avg']"


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_tensor_of_another_shape_is_refused_naming_file_and_key_before_loading(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer], where: str
) -> None:
    # Torch's loader copied every tensor that fit, then raised a bare RuntimeError on
    # every rank; its optimizer loader took moments of any shape without a word.
    trained, fresh = trainers
    assert trained.worker.optimizer is not None and fresh.worker.optimizer is not None
    state = {
        "world_size": 1,
        "layout": trained._layout(),
        "model": dict(trained.worker.model.state_dict()),
        "optimizer": copy.deepcopy(trained.worker.optimizer.state_dict()),
        "rng": rng_state(),
    }
    name = _wrong_shape(state, where)
    final = _commit(tmp_path, lambda path: save_rank_state(path, state))
    before = {k: v.clone() for k, v in fresh.worker.model.state_dict().items() if v is not None}
    moments = copy.deepcopy(fresh.worker.optimizer.state_dict())
    with pytest.raises(CheckpointError) as info:
        fresh.load_checkpoint(str(final))
    assert info.value.file == checkpoint_file(final, 0)
    assert info.value.expected.startswith(f"{name}: a tensor of shape [")
    assert info.value.got == "shape [3, 5]"
    after = fresh.worker.model.state_dict()
    assert all(torch.equal(value, after[k]) for k, value in before.items())
    now = fresh.worker.optimizer.state_dict()
    assert now["state"].keys() == moments["state"].keys()
    for index, fields in moments["state"].items():
        assert all(torch.equal(v, now["state"][index][f]) for f, v in fields.items())


def test_a_bad_rng_field_is_refused_before_anything_is_restored(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    assert trained.worker.optimizer is not None
    before = {k: v.clone() for k, v in fresh.worker.model.state_dict().items() if v is not None}
    rng = rng_state()
    rng["numpy"]["pos"] = 700
    state = {
        "world_size": 1,
        "layout": trained._layout(),
        "model": trained.worker.model.state_dict(),
        "optimizer": trained.worker.optimizer.state_dict(),
        "rng": rng,
    }
    final = _commit(tmp_path, lambda path: save_rank_state(path, state))
    _seed_rngs(5)
    expected = _draws()
    _seed_rngs(5)
    with pytest.raises(CheckpointError) as info:
        fresh.load_checkpoint(str(final))
    assert info.value.file == checkpoint_file(final, 0)
    assert (info.value.expected, info.value.got) == (
        "rng['numpy']['pos']: an int in [0, 624]",
        "700",
    )
    after = fresh.worker.model.state_dict()
    assert all(torch.equal(value, after[name]) for name, value in before.items())
    assert _draws() == expected  # the process's generators were left alone too


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("torch", torch.zeros(3, dtype=torch.uint8), "rng['torch']: a uint8 tensor of shape"),
        ("numpy.keys", torch.zeros(624), "rng['numpy']['keys']: a dict of MT19937"),
        ("numpy.keys", torch.full((624,), 2**32), "rng['numpy']['keys']: a dict of MT19937"),
        ("numpy.bit_generator", "PCG64", "rng['numpy']: numpy's MT19937 state"),
        ("python.state", ["seven"], "rng['python']['state']: a list of ints"),
        ("python.state", [1, 2, 3], "rng['python']: Python's random state"),
        ("python.version", 9, "rng['python']: Python's random state"),
    ],
)
def test_each_bad_rng_field_is_named(field: str, value: Any, expected: str) -> None:
    rng = rng_state()
    if "." in field:
        group, name = field.split(".")
        rng[group][name] = value
    else:
        rng[field] = value
    with pytest.raises(CheckpointError) as info:
        RngState.read({"rng": rng}, Path("policy_rank0.pt"))
    assert info.value.expected.startswith(expected)


def _convert(*args: str) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import convert_checkpoint
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return int(convert_checkpoint.main(list(args)))


def test_a_converted_format_1_checkpoint_resumes_with_identical_state(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer], capsys: pytest.CaptureFixture
) -> None:
    trained, fresh = trainers
    assert trained.worker.optimizer is not None
    _seed_rngs(11)
    state = _format_1_state(
        trained.worker.model.state_dict(), trained.worker.optimizer.state_dict()
    )
    legacy = _commit(tmp_path / "ckpts", lambda path: torch.save(state, path))
    expected = _draws()
    before = _digests(legacy)
    with pytest.raises(CheckpointError, match=CONVERT_SCRIPT):
        fresh.load_checkpoint(str(legacy))

    assert _convert("--checkpoint", str(legacy), "--trust-source") == 0
    converted = tmp_path / "ckpts" / "converted" / "step_000001"
    assert f"wrote {converted}" in capsys.readouterr().out
    assert _digests(legacy) == before  # the input is untouched
    assert verify_checkpoint(converted).step == 1
    assert (converted / DRIVER_FILE).read_bytes() == (legacy / DRIVER_FILE).read_bytes()
    _perturb(fresh)
    _seed_rngs(99)
    fresh.load_checkpoint(str(converted))
    assert _draws() == expected
    _assert_same_state(trained, fresh)


# ---------------------------------------------------------------- the script's guards


def test_convert_refuses_without_trust_and_never_writes_over_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    state = _format_1_state({"w": torch.arange(4.0)}, {"state": {}, "param_groups": []})
    legacy = _commit(tmp_path, lambda path: torch.save(state, path))
    before = _digests(legacy)
    with pytest.raises(SystemExit) as info:
        _convert("--checkpoint", str(legacy))
    assert info.value.code == 2
    assert "--trust-source: expected your word" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _convert("--checkpoint", str(legacy), "--trust-source", "--out", str(tmp_path))
    assert "--out: expected a folder other than the input's own" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert _digests(legacy) == before

    assert _convert("--checkpoint", str(legacy), "--trust-source", "--in-place") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    state = load_rank_state(legacy, rank=0, world_size=1)
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert _digests(legacy)[DRIVER_FILE] == before[DRIVER_FILE]


def test_convert_help_warns_that_it_unpickles() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "WARNING: this script unpickles" in out and "--trust-source" in out


def test_a_file_without_a_tensor_parallel_size_resumes_only_at_tp_1(tmp_path: Path) -> None:
    # Written before the layout recorded tensor parallelism, when only TP=1 ran; a
    # resume at another TP would load whole tensors into shards (docs/parallel-layouts.md).
    from skyrl_train.errors import ConfigValidationError

    old = {"pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1}
    state = {"world_size": 2, "layout": old, "model": {"w": torch.ones(2)}}
    final = _commit(tmp_path, lambda path: save_rank_state(path, state))
    now = {**old, "tensor_model_parallel_size": 1}
    assert load_rank_state(final, rank=0, world_size=2, layout=now)["world_size"] == 2
    with pytest.raises(ConfigValidationError) as info:
        load_rank_state(
            final, rank=0, world_size=2, layout={**now, "tensor_model_parallel_size": 2}
        )
    assert info.value.path == "trainer.policy.megatron_config.tensor_model_parallel_size"
    assert "the checkpoint's 1 to resume" in info.value.reason


MC = "trainer.policy.megatron_config"


def test_the_layout_records_etp_and_a_file_without_it_reads_as_etp_equal_to_its_tp(
    tmp_path: Path,
) -> None:
    # Expert weights are cut by ETP: a resume at another ETP that took its own file
    # loaded shards of another shape (issue 49), so ETP decides resharding like TP.
    # The record a Megatron rank reports (RankInfo.layout) and the trainer writes.
    cfg = load_config([f"trainer.run_dir={tmp_path}"])
    mc = cfg.trainer.policy.megatron_config
    mc.tensor_model_parallel_size, mc.expert_model_parallel_size = 2, 2
    assert parallel_layout(mc, world=4).record()["expert_tensor_parallel_size"] == 2  # null: TP
    mc.expert_tensor_parallel_size = 1
    now = parallel_layout(mc, world=4).record()
    assert now["expert_tensor_parallel_size"] == 1

    old = {k: v for k, v in now.items() if k != "expert_tensor_parallel_size"}
    saved = SavedLayout(world_size=4, layout=old, reshardable=True)
    assert same_layout(saved, world_size=4, layout={**now, "expert_tensor_parallel_size": 2})
    assert not same_layout(saved, world_size=4, layout=now)  # resharded
    # Before TP was recorded too: TP 1, so ETP 1.
    older = {k: v for k, v in old.items() if k != "tensor_model_parallel_size"}
    older_saved = SavedLayout(world_size=4, layout=older, reshardable=True)
    at_1 = {**now, "tensor_model_parallel_size": 1}
    assert same_layout(older_saved, world_size=4, layout=at_1)

    # A file without placement records resumes only its own ETP, refused naming the key.
    state = {"world_size": 4, "layout": old, "model": {"w": torch.ones(2)}}
    final = _commit(tmp_path, lambda path: save_rank_state(path, state))
    etp_2 = {**now, "expert_tensor_parallel_size": 2}
    assert load_rank_state(final, rank=0, world_size=4, layout=etp_2)["world_size"] == 4
    from skyrl_train.errors import ConfigValidationError

    with pytest.raises(ConfigValidationError) as info:
        load_rank_state(final, rank=0, world_size=4, layout=now)
    assert info.value.path == f"{MC}.expert_tensor_parallel_size"
    assert "the checkpoint's 2 to resume" in info.value.reason and info.value.got == "1"
