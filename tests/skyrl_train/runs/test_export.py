"""Hugging Face exports (``runs/export.py``) and ``scripts/export_hf.py``'s refusals,
without Ray: the weights stream from a transformers model, as the trainer's
``export_weights()`` streams them (the live modules' names, fp32).

End to end (a run's exports, the script on pipeline checkpoints, the round trip through
``model.path`` and the server): tests/skyrl_train/entrypoints/test_main_base*.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from inference.models.checkpoint import builtin_checkpoint, inspect_checkpoint
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.model_source import model_checkpoint_info
from skyrl_train.config.schema import ModelConfig
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, RUN_CONFIG_FILE, begin_save, commit_save
from skyrl_train.runs.export import (
    INDEX_FILE,
    MARKER_FILE,
    TOKENIZER_FILES,
    export_due,
    list_exports,
    read_marker,
    write_hf_export,
)
from skyrl_train.runs.folder import check_run_dir
from skyrl_train.utils.durable import write_file

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-MoE checkpoint (q/k/v biases, a shared expert, a dense first layer)."""
    return write_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2") / "in", seed=0)


@pytest.fixture(scope="module")
def trained(source: Path) -> dict[str, torch.Tensor]:
    """``source``'s weights, moved: what a trainer's stream would hold after training."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return {
        name: (p.detach() + 0.01 * torch.randn(p.shape, generator=generator))
        for name, p in model.named_parameters()
    }


def _stream(weights: dict[str, torch.Tensor]) -> Any:
    return iter(weights.items())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})
    return out


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    assert not any(v for k, v in info.items() if k != "error_msgs"), info
    return model


@pytest.mark.parametrize(
    ("interval", "steps"),
    [(0, [5]), (-1, []), (1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (5, [5]), (7, [5])],
)
def test_hf_save_interval_schedule(interval: int, steps: list[int]) -> None:
    due = [s for s in range(1, 6) if export_due(s, interval=interval, num_steps=5)]
    assert due == steps


def test_a_sharded_export_loads_in_transformers_as_the_trained_weights(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    limit = 60_000
    final = write_hf_export(
        tmp_path / "global_step_3", _stream(trained), source=source, step=3, max_shard_bytes=limit
    )
    shards = sorted(final.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (final / "model.safetensors").exists()
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    index = json.loads((final / INDEX_FILE).read_bytes())
    on_disk = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as fh:
            on_disk.update({name: shard.name for name in fh.keys()})
            sizes = [fh.get_tensor(n).numel() * 4 for n in fh.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, shard.name
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in trained.values())
    # save_pretrained's layout: the tensor names the input's own file holds.
    assert set(on_disk) == set(_tensors(source))

    loaded = dict(_load(final).named_parameters())
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[name].detach(), trained[name]) for name in trained)
    marker = read_marker(final)
    assert marker is not None and marker["step"] == 3
    assert sorted(f["name"] for f in marker["files"]) == sorted(
        p.name for p in final.iterdir() if p.name != MARKER_FILE
    )


def test_below_the_limit_one_file_and_no_index(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    final = write_hf_export(tmp_path / "out", _stream(trained), source=source, step=None)
    assert sorted(p.name for p in final.glob("model*")) == ["model.safetensors"]
    tensors = _tensors(final)
    assert len(tensors) == len(_tensors(source))


def test_config_tokenizer_and_eos_are_the_inputs(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    final = write_hf_export(tmp_path / "out", _stream(trained), source=source, step=1)
    assert (final / "config.json").read_bytes() == (source / "config.json").read_bytes()
    copied = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    assert "chat_template.jinja" in copied and "tokenizer.json" in copied
    for name in copied:
        assert (final / name).read_bytes() == (source / name).read_bytes(), name
    ours, theirs = (AutoTokenizer.from_pretrained(str(p)) for p in (final, source))
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert ours.apply_chat_template(chat, tokenize=True) == theirs.apply_chat_template(
        chat, tokenize=True
    )
    info = inspect_checkpoint(final)
    assert info.eos_token_ids == inspect_checkpoint(source).eos_token_ids
    assert len(info.eos_token_ids) == 2  # the tiny checkpoint's list, kept as it is


def test_eos_ids_come_from_the_tokenizer_and_the_dtype_from_the_config(tmp_path: Path) -> None:
    """The built-in model's generation_config.json names no EOS; the export's names the
    tokenizer's, which is what the engine used. A bf16 input exports in bf16."""
    from transformers import AutoModelForCausalLM

    tiny = TinyMoEConfig(num_layers=1, num_experts=2, num_experts_per_tok=1, hidden_size=16)
    builtin = builtin_checkpoint(tiny, seed=0, cache_dir=tmp_path / "cache")
    assert "eos_token_id" not in json.loads((builtin / "generation_config.json").read_bytes())
    model = AutoModelForCausalLM.from_pretrained(str(builtin), dtype=torch.float32)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    final = write_hf_export(tmp_path / "fp32", _stream(weights), source=builtin, step=1)
    generation = json.loads((final / "generation_config.json").read_bytes())
    assert generation["eos_token_id"] == inspect_checkpoint(builtin).eos_token_ids[0]
    assert all(t.dtype == torch.float32 for t in _tensors(final).values())

    bf16 = tmp_path / "bf16_source"
    bf16.mkdir()
    for file in builtin.iterdir():
        (bf16 / file.name).write_bytes(file.read_bytes())
    config = json.loads((bf16 / "config.json").read_bytes())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    final = write_hf_export(tmp_path / "bf16", _stream(weights), source=bf16, step=1)
    assert all(t.dtype == torch.bfloat16 for t in _tensors(final).values())


def test_targets_that_are_not_exports_are_refused_naming_them(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        write_hf_export(source, _stream(trained), source=source, step=1, key="--out")
    assert info.value.path == "--out" and str(source) in str(info.value)
    assert "config.json" in str(info.value)
    assert list(source.parent.glob("*.tmp-*")) == []  # refused before anything was made
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigValidationError, match="a file"):
        write_hf_export(a_file, _stream(trained), source=source, step=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_hf_export(empty, _stream(trained), source=source, step=1) == empty
    assert read_marker(empty) is not None


def test_an_export_replaces_an_earlier_one_and_removes_stale_temp_folders(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    root = tmp_path / "exports"
    write_hf_export(root / "global_step_1", _stream(trained), source=source, step=1)
    stale = [root / "global_step_7.tmp-0a1b2c3d", root / "global_step_1.tmp-00000000"]
    for folder in stale:
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    kept = root / "global_step_1.tmp-notours"
    kept.mkdir()
    halved = {name: t / 2 for name, t in trained.items()}
    write_hf_export(root / "global_step_1", _stream(halved), source=source, step=11)
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", kept.name]
    assert read_marker(root / "global_step_1")["step"] == 11  # type: ignore[index]
    loaded = dict(_load(root / "global_step_1").named_parameters())
    assert all(torch.equal(loaded[n].detach(), halved[n]) for n in halved)


_KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from skyrl_train.runs.export import write_hf_export

source, final, pause_at = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)

def pause(path):
    if path.name.startswith(pause_at):
        print(path.name, flush=True)
        time.sleep(600)

weights = ((n, 3 * p.detach()) for n, p in model.named_parameters())
write_hf_export(final, weights, source=source, step=2, max_shard_bytes=60_000, on_file=pause)
"""


def test_config_json_is_written_after_the_weights_and_the_tokenizer(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """So a temp folder cut short before its last files is no model folder at all."""
    order: list[str] = []
    write_hf_export(
        tmp_path / "out",
        _stream(trained),
        source=source,
        step=1,
        max_shard_bytes=60_000,
        on_file=lambda path: order.append(path.name),
    )
    assert order[-1] == "config.json"
    assert order[0].startswith("model-00001-of-") and INDEX_FILE in order


def test_an_export_killed_between_files_leaves_the_previous_one_whole(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Killed at the last file before the marker: the temp folder holds a whole model
    folder's files, and still nothing takes it for an export."""
    pause_at = "config.json"
    root = tmp_path / "exports"
    previous = write_hf_export(root / "global_step_1", _stream(trained), source=source, step=1)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(source), str(previous), pause_at],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        written = writer.stdout.readline().strip()
        assert written.startswith(pause_at), writer.stderr.read() if writer.stderr else written
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
    # The previous export is untouched; the killed one is a temp folder only.
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    (temp,) = root.glob("global_step_1.tmp-*")
    assert written in {p.name for p in temp.iterdir()} and not (temp / MARKER_FILE).exists()
    assert (temp / "model.safetensors.index.json").is_file()
    assert list_exports(root) == [(1, previous)]
    with pytest.raises(ConfigValidationError) as info:
        model_checkpoint_info(ModelConfig(path=str(temp)))
    assert info.value.path == "model.path" and "never finished" in str(info.value)
    # The next export removes it.
    write_hf_export(root / "global_step_2", _stream(trained), source=source, step=2)
    assert [p.name for p in sorted(root.iterdir())] == ["global_step_1", "global_step_2"]


def test_an_export_path_holding_another_runs_exports_is_refused(
    source: Path, trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    write_hf_export(
        shared / "global_step_5", _stream(trained), source=source, step=5, run_dir=tmp_path / "a"
    )
    own = load_config([f"trainer.run_dir={tmp_path / 'a'}", f"trainer.export_path={shared}"])
    check_run_dir(own.trainer)  # the run that wrote them may resume into it
    other = load_config([f"trainer.run_dir={tmp_path / 'b'}", f"trainer.export_path={shared}"])
    with pytest.raises(ConfigValidationError) as info:
        check_run_dir(other.trainer)
    assert info.value.path == "trainer.export_path"
    assert str(shared / "global_step_5") in str(info.value)


# ----------------------------------------------------- scripts/export_hf.py's refusals


def _export_script(*args: str) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import export_hf
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return int(export_hf.main(list(args)))


def _checkpoint(root: Path, *, run_config: bool = True) -> Path:
    folder = begin_save(root, step=4)
    write_file(folder / "policy_rank0.pt", b"rank 0")
    write_file(folder / DRIVER_FILE, json.dumps({"step": 4, "world_size": 1}).encode())
    if run_config:
        record = {"trainer": {"placement": {"num_trainers": 1}}}
        write_file(folder / RUN_CONFIG_FILE, json.dumps(record).encode())
    return commit_save(folder, step=4)


def test_the_script_refuses_bad_inputs_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    missing = tmp_path / "checkpoints" / "step_000009"
    assert _export_script("--checkpoint", str(missing), "--out", out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --checkpoint: {missing}: expected a checkpoint folder"), err

    damaged = _checkpoint(tmp_path / "damaged")
    (damaged / "manifest.json").write_text("{not json")
    assert _export_script("--checkpoint", str(damaged), "--out", out) == 1
    err = capsys.readouterr().err
    assert f"--checkpoint: {damaged / 'manifest.json'}: expected a JSON object" in err, err

    older = _checkpoint(tmp_path / "older", run_config=False)
    assert _export_script("--checkpoint", str(older), "--out", out) == 1
    assert f"{older / RUN_CONFIG_FILE}: expected the {RUN_CONFIG_FILE}" in capsys.readouterr().err

    good = _checkpoint(tmp_path / "good")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert _export_script("--checkpoint", str(good), "--out", str(taken)) == 1
    err = capsys.readouterr().err
    assert "error: --out: expected a new or empty folder" in err and str(taken) in err, err
    assert (taken / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.tmp-*"))
