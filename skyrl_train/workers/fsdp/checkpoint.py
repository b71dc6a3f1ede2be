"""The FSDP backend's checkpoint pair: one rank's shards of the model and of AdamW as
plain data, its placement records, and the way back (``runs.rank_contract.Checkpointable``).

The issue asks to save and resume "with torch.distributed.checkpoint". Its
``state_dict`` API is what takes and restores the sharded state here
(``get_model_state_dict``, ``get_optimizer_state_dict``, ``set_model_state_dict``,
``set_optimizer_state_dict``, ``StateDictOptions``): each rank's DTensor shards, keyed by
the model's own parameter names. Its on-disk format is not used: DCP's
``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, which runs
whatever code the file names, and a checkpoint folder is something anyone can hand over
(``runs/rank_file.py``; docs/checkpoints.md). The shards go into the project's own rank
files instead (``policy_rank<r>.pt``, plain data read with ``torch.load(weights_only=True)``,
listed in the folder's manifest, committed atomically, ``latest``), with the
guarantees Megatron's checkpoints have, RNG states included (``runs.resume.rank_checkpoint``).

A rank's state, as Megatron's worker writes it (``runs.rank_contract.Checkpointable``):

- ``"model"``: every parameter and persistent buffer under its ``named_parameters`` /
  ``named_buffers`` name, the rank's local shard (``DTensor.to_local``) as a plain tensor;
- ``"optimizer"``: AdamW's state indexed in parameter order, each moment the rank's
  shard of it (FSDP2 shards moments as their parameter), ``step`` as AdamW keeps it, and
  its one parameter group;
- ``"placement"``: per parameter, the layout-free key (its HF name: the engine's
  weight names, ``workers/fsdp/model.py``), dim 0, the rank's shard index and the shard
  count. FSDP2 cuts dim 0 with ``torch.chunk``, the last shards shorter or empty
  (``utils/shards.py`` cuts the same way), so ``runs/reshard.py`` resumes a checkpoint
  under another number of FSDP ranks;
- ``"strategy"``: ``"fsdp"`` (``runs/resume.py``): a Megatron run refuses it and an
  FSDP run refuses Megatron's.

The layout an FSDP rank reports (``parallel_layout``) has no tensor, pipeline or expert
split: each size 1, data-parallel over the world, the record every FSDP rank file has
carried.

Loading checks every entry against the live model (names, shapes, dtypes) before
anything changes; a mismatch is a ``StateMismatch`` that the resume names after the
rank file (``CheckpointError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from skyrl_train.runs.rank_contract import (
    PLACEMENT_KEY,
    STRATEGY_KEY,
    UNNAMED_STRATEGY,
    ParallelLayout,
    Placement,
    StateMismatch,
)

STRATEGY = "fsdp"
"""``trainer.strategy`` of this backend, recorded in its rank files."""
_MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIONS = StateDictOptions(full_state_dict=False, strict=True)
"""Sharded (DTensor) state dicts, every key required on load."""


def parallel_layout(world: int) -> ParallelLayout:
    """The layout an FSDP rank of ``world`` ranks reports (``RankInfo.layout``)."""
    return ParallelLayout(
        backend=STRATEGY, world=world, tp=1, pp=1, vpp=None, ep=1, etp=1, dp=world
    )


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's checkpoint state (the module docstring's form): its shards only,
    no collective."""
    names = _parameter_names(model)
    model_state = get_model_state_dict(model, options=_OPTIONS)
    owner = _owners(model)
    saved_model = {
        key: _plain(value) for key, value in model_state.items() if owner.get(key, key) == key
    }
    return {
        "model": saved_model,
        "optimizer": _optimizer_state(model, optimizer, names),
        PLACEMENT_KEY: placement_record(model),
        STRATEGY_KEY: STRATEGY,
    }


def load_checkpoint_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Load a ``checkpoint_state`` of this layout (or one ``runs/reshard.py`` cut for
    it) into ``model`` and ``optimizer``; ``StateMismatch`` names the first entry that
    does not fit, raised before anything is loaded."""
    strategy = state.get(STRATEGY_KEY, UNNAMED_STRATEGY)
    if strategy != STRATEGY:
        raise StateMismatch(STRATEGY_KEY, expected=repr(STRATEGY), got=repr(strategy))
    live: dict[str, Any] = get_model_state_dict(model, options=_OPTIONS)
    owner = _owners(model)
    saved = _mapping(state.get("model"), "model")
    extra = sorted(saved.keys() - {owner.get(key, key) for key in live})
    if extra:
        raise StateMismatch(
            f"model[{extra[0]!r}]", expected="an entry of this model", got="an extra entry"
        )
    model_state: dict[str, Any] = {}
    for key, target in live.items():
        # A tied weight's second name (lm_head under tie_word_embeddings) is not saved.
        own = owner.get(key, key)
        model_state[key] = _like(saved.get(own), target, f"model[{own!r}]")
    names = _parameter_names(model)
    params = dict(model.named_parameters())
    optim = _mapping(state.get("optimizer"), "optimizer")
    groups = optim.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        raise StateMismatch(
            "optimizer['param_groups']", expected="one AdamW parameter group", got=repr(groups)
        )
    group = {k: v for k, v in groups[0].items() if k != "params"}
    if groups[0].get("params") != list(range(len(names))):
        raise StateMismatch(
            "optimizer['param_groups'][0]['params']",
            expected=f"the indexes of this model's {len(names)} parameters",
            got=repr(groups[0].get("params")),
        )
    moments = _mapping(optim.get("state"), "optimizer['state']")
    optim_state: dict[str, dict[str, Any]] = {}
    for index, fields in moments.items():
        where = f"optimizer['state'][{index!r}]"
        if not isinstance(index, int) or not 0 <= index < len(names):
            raise StateMismatch(
                "optimizer['state']",
                expected=f"parameter indexes in [0, {len(names)})",
                got=repr(index),
            )
        fields = _mapping(fields, where)
        step = fields.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1:
            raise StateMismatch(
                f"{where}['step']", expected="a one-element tensor", got=_kind(step)
            )
        param = params[names[index]]
        loaded = {"step": step.clone()}
        for moment in _MOMENTS:
            loaded[moment] = _like(fields.get(moment), param, f"{where}[{moment!r}]")
        optim_state[names[index]] = loaded
    set_model_state_dict(model, model_state, options=_OPTIONS)
    if optim_state:
        restored: Any = {"state": optim_state, "param_groups": [{**group, "params": names}]}
        set_optimizer_state_dict(model, optimizer, restored, options=_OPTIONS)
    else:
        # A checkpoint before the first step: DCP's setter would first step the
        # optimizer at lr 0 to create its state (_init_optim_state), and with
        # strict=True refuse the empty one; torch's own loader empties the state.
        empty = {"state": {}, "param_groups": [{**group, "params": list(range(len(names)))}]}
        optimizer.load_state_dict(empty)


def placement_record(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Each parameter's ``Placement`` as plain data, in parameter order: its name as
    the key, dim 0, this rank's shard index and the shard count (1 for a parameter
    FSDP left whole)."""
    record = []
    for name, param in model.named_parameters():
        index, count = 0, 1
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
                raise ValueError(
                    f"{name}: expected FSDP2's dim-0 shard over a 1-D mesh, got "
                    f"{param.placements} over a {mesh.ndim}-D mesh"
                )
            index, count = mesh.get_local_rank(), mesh.size()
        placement = Placement(key=name, dim=0, tp_rank=index, tp_size=count, gated=False)
        record.append({"name": name, **dataclasses.asdict(placement)})
    return record


# --------------------------------------------------------------------------- helpers


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _owners(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter and buffer name of ``model`` and the name its tensor is saved
    under: its own, or the first name of a tensor two modules share (a tied weight)."""
    first: dict[int, str] = {}
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    return {name: first.setdefault(id(tensor), name) for name, tensor in named}


def _optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
) -> dict[str, Any]:
    """AdamW's state of this rank's shards, indexed in parameter order."""
    if not optimizer.state:
        # Not get_optimizer_state_dict: before the first step it steps the optimizer
        # at lr 0 to create the state, so AdamW's step count (the warm-up's and the bias
        # correction's) would read 1 without a step taken.
        groups = optimizer.state_dict()["param_groups"]
        return {"state": {}, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}
    full: Any = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    index = {name: i for i, name in enumerate(names)}
    groups = full["param_groups"]
    if len(groups) != 1 or list(groups[0]["params"]) != names:
        raise ValueError("optimizer: expected one parameter group of every model parameter")
    return {
        "state": {
            index[name]: {field: _plain(value) for field, value in fields.items()}
            for name, fields in full["state"].items()
        },
        "param_groups": [{**groups[0], "params": list(range(len(names)))}],
    }


def _plain(value: Any) -> Any:
    """A tensor or DTensor as the rank's own plain CPU tensor, in a storage of its own
    (FSDP2's local shard can be a view into its padded buffer, which torch.save would
    write whole; on CPU, a file reads back on any machine); anything else as it is."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def _like(value: Any, target: torch.Tensor, where: str) -> torch.Tensor:
    """``value``, the local shard of ``target``'s layout, as a tensor ``target``'s
    setter takes (a DTensor of the same mesh and placement when ``target`` is one)."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if not isinstance(value, torch.Tensor):
        raise StateMismatch(
            where, expected=f"a tensor of shape {list(local.shape)}", got=_kind(value)
        )
    if value.shape != local.shape or value.dtype != local.dtype:
        raise StateMismatch(
            where,
            expected=f"a {local.dtype} tensor of shape {list(local.shape)}",
            got=f"a {value.dtype} tensor of shape {list(value.shape)}",
        )
    value = value.to(local.device)
    if isinstance(target, DTensor):
        return DTensor.from_local(
            value,
            device_mesh=target.device_mesh,
            placements=target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    return value


def _mapping(value: Any, where: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise StateMismatch(where, expected="a dict", got=_kind(value))
    return value


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"a {type(value).__name__}"
