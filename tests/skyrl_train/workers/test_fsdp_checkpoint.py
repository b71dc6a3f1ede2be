"""The FSDP backend's checkpoints (``workers/fsdp/checkpoint.py``) through the run
folders' own path: rank files written by ``rank_checkpoint``/``save_rank_state`` into a
committed folder, restored by ``restore_rank``, on a transformers Qwen3-MoE model
``fully_shard``ed per decoder layer (``workers/fsdp/model.shard_model``) with the shared
AdamW, fp32.

One rank runs in this process (a gloo world of one). The two-rank checks run in one
spawn of two gloo ranks: the one-rank checkpoint resumed on two ranks, a two-rank round
trip and resume, and a two-rank checkpoint that this process then resumes on one rank.
Three experts over two ranks shard 2 + 1, so the uneven chunking is resharded too.
Last, ``FSDPPolicyWorker`` itself: saved and resumed by a trainer rank
(``PolicyTrainer``), and its HF export loaded in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import one_rank_group, run_group
from torch.distributed.tensor import DTensor

from inference.models.checkpoint import builtin_checkpoint
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.algorithms.optim import build_optimizer, optimizer_step
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import FSDPConfig, OptimizerConfig
from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save
from skyrl_train.runs.export import write_hf_export
from skyrl_train.runs.folder import CHECKPOINTS_DIR, resolve_resume
from skyrl_train.runs.rank_contract import PLACEMENT_KEY, STRATEGY_KEY, ParallelLayout
from skyrl_train.runs.rank_file import checkpoint_file, read_plain, save_rank_state
from skyrl_train.runs.resume import rank_checkpoint, restore_rank, verify_resume
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.utils.durable import write_file
from skyrl_train.workers.fsdp import checkpoint as fsdp_checkpoint
from skyrl_train.workers.fsdp.model import shard_model
from skyrl_train.workers.fsdp.state import clip_grad_norm, full_tensor

CFG = TinyMoEConfig(
    num_layers=2,
    num_experts=3,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
)
LR = 1e-2
STEPS = 2
"""Steps taken before the save; the resume check takes one more."""
WORLD = 2


class _Rank:
    """One FSDP rank's model and AdamW with the backend's checkpoint pair (what
    ``FSDPPolicyWorker`` delegates to)."""

    def __init__(self, *, seed: int, config: TinyMoEConfig = CFG) -> None:
        self.model: Any = build_hf_model(config, seed=seed).train()
        shard_model(self.model, FSDPConfig())
        self.optimizer = build_optimizer(self.model.parameters(), OptimizerConfig(lr=LR))

    def checkpoint_state(self) -> dict[str, Any]:
        return fsdp_checkpoint.checkpoint_state(self.model, self.optimizer)

    def load_checkpoint_state(self, state: Any) -> None:
        fsdp_checkpoint.load_checkpoint_state(self.model, self.optimizer, state)

    def step(self, step: int, *, rank: int = 0) -> tuple[float, float]:
        """One AdamW step on rank ``rank``'s rows of step ``step``: (loss, grad norm)."""
        ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=_gen(100 * step + rank))
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = clip_grad_norm(self.model, max_norm=1.0)
        assert optimizer_step(self.optimizer, lr=LR, grad_norm=norm)
        return float(loss.detach()), norm

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's shards of every weight and AdamW field, copied."""
        return _flat(self.model, self.optimizer, _local)

    def full(self) -> dict[str, torch.Tensor]:
        """Every weight and AdamW field whole (all-gathers: every rank calls it)."""
        return _flat(self.model, self.optimizer, full_tensor)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return value.detach().clone()


def _flat(model: Any, optimizer: torch.optim.Optimizer, take: Any) -> dict[str, torch.Tensor]:
    found = {}
    for name, param in model.named_parameters():
        found[name] = take(param)
        for field, value in optimizer.state.get(param, {}).items():
            found[f"{name}/{field}"] = take(value) if field != "step" else value.clone()
    return found


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and any(k.endswith("/exp_avg_sq") for k in want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _save(root: Path, ranked: _Rank, *, rank: int, world_size: int, step: int) -> Path:
    """A committed checkpoint of ``world_size`` ranks (every rank calls this)."""
    dist = torch.distributed
    folder = [begin_save(root, step=step) if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    state = rank_checkpoint(ranked, world_size=world_size, layout={})
    save_rank_state(checkpoint_file(folder[0], rank), state)
    dist.barrier()
    final = [None]
    if rank == 0:
        driver = {"step": step, "world_size": world_size}
        write_file(folder[0] / DRIVER_FILE, json.dumps(driver).encode())
        final = [commit_save(folder[0], step=step)]
    dist.broadcast_object_list(final, src=0)
    return final[0]


def _restore(folder: Path, ranked: _Rank, *, rank: int, world_size: int) -> Any:
    return restore_rank(
        folder, ranked, rank=rank, world_size=world_size, layout={}, strategy="fsdp"
    )


# ------------------------------------------------------------------- one rank, here


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    with one_rank_group():
        assert torch.distributed.get_world_size() == 1
        yield


@pytest.fixture(scope="module")
def one_rank(group: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A one-rank run saved after ``STEPS`` steps: the folder, the state it saved, and
    the next step's loss, grad norm and weights without a save in between."""
    ranked = _Rank(seed=0)
    for step in range(STEPS):
        ranked.step(step)
    folder = _save(tmp_path_factory.mktemp("one"), ranked, rank=0, world_size=1, step=STEPS)
    saved = ranked.local()
    loss, norm = ranked.step(STEPS)
    return {"folder": folder, "saved": saved, "loss": loss, "norm": norm, "next": ranked.local()}


def test_one_rank_round_trip_is_bit_identical(one_rank: dict[str, Any]) -> None:
    fresh = _Rank(seed=5)
    assert _restore(one_rank["folder"], fresh, rank=0, world_size=1) is None  # same layout
    _assert_equal(fresh.local(), one_rank["saved"])
    assert int(fresh.local()["lm_head.weight/step"]) == STEPS


def test_one_rank_resume_equals_the_uninterrupted_run(one_rank: dict[str, Any]) -> None:
    fresh = _Rank(seed=5)
    _restore(one_rank["folder"], fresh, rank=0, world_size=1)
    loss, norm = fresh.step(STEPS)
    assert (loss, norm) == (one_rank["loss"], one_rank["norm"])
    _assert_equal(fresh.local(), one_rank["next"])


def test_a_checkpoint_before_the_first_step_keeps_adamw_unstepped(
    group: None, tmp_path: Path
) -> None:
    # torch's get_optimizer_state_dict would step an empty AdamW at lr 0 (step 1).
    ranked = _Rank(seed=0)
    folder = _save(tmp_path, ranked, rank=0, world_size=1, step=0)
    assert not ranked.optimizer.state
    fresh = _Rank(seed=5)
    fresh.step(0)
    _restore(folder, fresh, rank=0, world_size=1)
    assert not fresh.optimizer.state
    _assert_equal_weights(fresh, ranked)


def test_tied_embeddings_are_saved_once_and_stay_tied(group: None, tmp_path: Path) -> None:
    tied = dataclasses.replace(CFG, tie_word_embeddings=True)
    ranked = _Rank(seed=0, config=tied)
    ranked.step(0)
    folder = _save(tmp_path, ranked, rank=0, world_size=1, step=1)
    saved = read_plain(checkpoint_file(folder, 0))["model"]
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved
    fresh = _Rank(seed=5, config=tied)
    fresh.step(0)
    _restore(folder, fresh, rank=0, world_size=1)
    _assert_equal(fresh.local(), ranked.local())
    assert fresh.model.lm_head.weight is fresh.model.model.embed_tokens.weight


def _assert_equal_weights(got: _Rank, want: _Rank) -> None:
    mine = dict(got.model.named_parameters())
    for name, param in want.model.named_parameters():
        assert torch.equal(_local(mine[name]), _local(param)), name


def _copy(folder: Path, dest: Path, change: Any) -> Path:
    """A committed copy of ``folder`` with rank 0's state changed by ``change``."""
    temp = begin_save(dest, step=STEPS)
    for path in folder.iterdir():
        if path.name != "manifest.json":
            write_file(temp / path.name, path.read_bytes())
    state = read_plain(checkpoint_file(temp, 0))
    change(state)
    checkpoint_file(temp, 0).unlink()
    save_rank_state(checkpoint_file(temp, 0), state)
    return commit_save(temp, step=STEPS)


def test_a_mismatched_rank_file_is_refused_naming_file_and_entry(
    one_rank: dict[str, Any], tmp_path: Path
) -> None:
    def shorten(state: dict[str, Any]) -> None:
        state["model"]["model.norm.weight"] = state["model"]["model.norm.weight"][:-1]

    def drop_moment(state: dict[str, Any]) -> None:
        del state["optimizer"]["state"][3]["exp_avg"]

    fresh = _Rank(seed=5)
    fresh.step(0)
    before = fresh.local()
    cases = [
        (shorten, "model['model.norm.weight']: a torch.float32 tensor of shape [32]"),
        (drop_moment, "optimizer['state'][3]['exp_avg']: a tensor of shape"),
    ]
    for index, (change, expected) in enumerate(cases):
        folder = _copy(one_rank["folder"], tmp_path / str(index), change)
        with pytest.raises(CheckpointError) as info:
            _restore(folder, fresh, rank=0, world_size=1)
        assert info.value.file == checkpoint_file(folder, 0)
        assert info.value.expected.startswith(expected), info.value.expected
        _assert_equal(fresh.local(), before)  # nothing was loaded


def test_another_backends_checkpoint_is_refused_before_loading(
    one_rank: dict[str, Any], tmp_path: Path
) -> None:
    # A rank file that names no backend is Megatron's (its worker writes none).
    megatron = _copy(one_rank["folder"], tmp_path / "megatron", lambda s: s.pop(STRATEGY_KEY))
    with pytest.raises(ConfigValidationError) as info:
        verify_resume(load_config([f"trainer.resume_from={megatron}", "trainer.strategy=fsdp"]))
    assert info.value.path == "trainer.strategy"
    assert (
        info.value.expected == f"the checkpoint's strategy 'megatron' to resume {str(megatron)!r}"
    )
    assert info.value.got == "'fsdp'"
    with pytest.raises(ConfigValidationError) as info:
        verify_resume(load_config([f"trainer.resume_from={one_rank['folder']}"]))
    assert info.value.path == "trainer.strategy" and info.value.got == "'megatron'"
    assert "strategy 'fsdp'" in info.value.expected
    assert verify_resume(
        load_config([f"trainer.resume_from={one_rank['folder']}", "trainer.strategy=fsdp"])
    )
    # trainer.resume_from=latest checks the checkpoint it picks the same way.
    run_dir = tmp_path / "run"
    _copy(one_rank["folder"], run_dir / CHECKPOINTS_DIR, lambda s: None)
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(load_config([f"trainer.run_dir={run_dir}", "trainer.resume_from=latest"]))
    assert info.value.path == "trainer.strategy" and info.value.got == "'megatron'"

    fresh = _Rank(seed=5)
    fresh.step(0)
    before = fresh.local()
    with pytest.raises(ConfigValidationError) as info:
        _restore(megatron, fresh, rank=0, world_size=1)
    assert info.value.path == "trainer.strategy"
    # A rank told no strategy: the backend's own check names the file.
    with pytest.raises(CheckpointError) as err:
        restore_rank(megatron, fresh, rank=0, world_size=1, layout={})
    assert err.value.file == checkpoint_file(megatron, 0)
    assert err.value.expected == "strategy: 'fsdp'" and err.value.got == "'megatron'"
    _assert_equal(fresh.local(), before)


def test_placement_records_name_each_parameter_and_its_dim0_shard(
    one_rank: dict[str, Any],
) -> None:
    state = read_plain(checkpoint_file(one_rank["folder"], 0))
    names = [name for name, _ in _Rank(seed=0).model.named_parameters()]
    assert [e["name"] for e in state[PLACEMENT_KEY]] == names
    assert all(e["key"] == e["name"] and e["dim"] == 0 for e in state[PLACEMENT_KEY])
    assert {(e["tp_rank"], e["tp_size"]) for e in state[PLACEMENT_KEY]} == {(0, 1)}
    assert state[STRATEGY_KEY] == "fsdp" and state["world_size"] == 1


# -------------------------------------------------------------------- two ranks


def _rank_main(rank: int, one: str, out: str) -> None:
    # 1 -> 2: the one-rank checkpoint, resharded, holds the saved state whole.
    fresh = _Rank(seed=5)
    resharded = _restore(Path(one), fresh, rank=rank, world_size=WORLD)
    assert resharded is not None and resharded.rng_from == (0 if rank == 0 else None)
    whole = fresh.full()
    if rank == 0:
        torch.save(whole, Path(out) / "from_one.pt")

    # A two-rank run: round trip and resume.
    ranked = _Rank(seed=0)
    for step in range(STEPS):
        ranked.step(step, rank=rank)
    folder = _save(Path(out) / "two", ranked, rank=rank, world_size=WORLD, step=STEPS)
    saved, saved_whole = ranked.local(), ranked.full()
    expected = ranked.step(STEPS, rank=rank)
    after = ranked.local()

    again = _Rank(seed=5)
    assert _restore(folder, again, rank=rank, world_size=WORLD) is None
    _assert_equal(again.local(), saved)
    got = again.step(STEPS, rank=rank)
    assert got == expected, (got, expected)
    _assert_equal(again.local(), after)
    if rank == 0:
        torch.save({"folder": str(folder), "whole": saved_whole}, Path(out) / "two.pt")
    # Three experts over two ranks: rank 0 holds two, rank 1 one.
    experts = dict(again.model.named_parameters())["model.layers.0.mlp.experts.down_proj"]
    assert experts.to_local().shape[0] == (2 if rank == 0 else 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_round_trip_resume_and_reshard_both_ways(
    one_rank: dict[str, Any], tmp_path: Path
) -> None:
    run_group(
        _rank_main,
        args=(str(one_rank["folder"]), str(tmp_path)),
        nprocs=WORLD,
        rendezvous=tmp_path / "rendezvous",
    )
    _assert_equal(torch.load(tmp_path / "from_one.pt", weights_only=True), one_rank["saved"])

    # 2 -> 1: this process resumes the two-rank checkpoint on one rank.
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    fresh = _Rank(seed=5)
    resharded = _restore(Path(two["folder"]), fresh, rank=0, world_size=1)
    assert resharded is not None and resharded.moments == len(list(fresh.model.parameters()))
    _assert_equal(fresh.local(), two["whole"])
    shutil.rmtree(tmp_path / "two", ignore_errors=True)


# ---------------------------------------------------- the worker and its HF export


@pytest.fixture(scope="module")
def trained_worker(group: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """An ``FSDPPolicyWorker`` on the built-in checkpoint after two replayed steps."""
    from _fsdp_pairs import build_fsdp, layout_batch
    from _megatron_batches import PAD_ID

    config = TinyMoEConfig()
    source = builtin_checkpoint(config, seed=3, cache_dir=tmp_path_factory.mktemp("builtin"))
    worker = build_fsdp(
        source, config.architecture(), optimizer=OptimizerConfig(lr=LR), pad_token_id=PAD_ID
    )
    batch = layout_batch(config.architecture(), vocab=config.vocab_size)
    for _ in range(STEPS):
        worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
    return worker, source


def test_the_fsdp_worker_reports_its_layout(trained_worker: tuple[Any, Path]) -> None:
    # What the trainer records in each rank file (RankInfo.layout), the record FSDP's
    # files have always had: every size 1, data-parallel over the world.
    worker, _source = trained_worker
    layout = worker.rank_info().layout
    assert layout == ParallelLayout(
        backend="fsdp", world=1, tp=1, pp=1, vpp=None, ep=1, etp=1, dp=1
    )
    assert layout.record() == {
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "expert_model_parallel_size": 1,
        "tensor_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }


def _trainer(cfg: Any, source: Path, worker: Any) -> PolicyTrainer:
    trainer = PolicyTrainer(cfg, checkpoint=str(source), pad_token_id=0)
    trainer.worker = worker
    trainer.info = worker.rank_info()
    return trainer


def test_a_trainer_rank_saves_and_resumes_the_fsdp_worker(
    trained_worker: tuple[Any, Path], tmp_path: Path
) -> None:
    from _fsdp_pairs import build_fsdp, layout_batch
    from _megatron_batches import PAD_ID

    worker, source = trained_worker
    cfg = load_config([f"trainer.run_dir={tmp_path}", "trainer.strategy=fsdp"])
    temp = begin_save(tmp_path / "checkpoints", step=STEPS)
    _trainer(cfg, source, worker).save_checkpoint(str(temp))
    write_file(temp / DRIVER_FILE, json.dumps({"step": STEPS, "world_size": 1}).encode())
    folder = commit_save(temp, step=STEPS)
    fresh = build_fsdp(
        source, worker.architecture, optimizer=OptimizerConfig(lr=LR), pad_token_id=PAD_ID
    )
    _trainer(cfg, source, fresh).load_checkpoint(str(folder))
    _assert_equal(
        _flat(fresh.model, fresh.optimizer, _local), _flat(worker.model, worker.optimizer, _local)
    )
    assert fresh.scheduled_lr() == worker.scheduled_lr()
    # The next train_step is the uninterrupted worker's.
    batch = layout_batch(worker.architecture, vocab=TinyMoEConfig().vocab_size, seed=1)
    steps = [
        w.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
        for w in (worker, fresh)
    ]
    assert (steps[0].loss, steps[0].grad_norm) == (steps[1].loss, steps[1].grad_norm)
    _assert_equal(
        _flat(fresh.model, fresh.optimizer, _local), _flat(worker.model, worker.optimizer, _local)
    )


def test_the_hf_export_loads_in_transformers_and_generates_what_the_fsdp_model_does(
    trained_worker: tuple[Any, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    worker, source = trained_worker
    final = write_hf_export(
        tmp_path / "global_step_2", worker.export_weights(), source=source, step=STEPS
    )
    exported = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    trained = dict(exported.named_parameters())
    assert any(not torch.equal(trained[n], p) for n, p in original.named_parameters())
    prompt = torch.tensor([[72, 101, 108, 108, 111, 44, 32]])
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    worker.model.eval()
    with torch.no_grad():
        want = worker.model.generate(prompt, **options)
        got = exported.generate(prompt, **options)
    assert want.shape[1] > prompt.shape[1]
    assert torch.equal(got, want), (got, want)
