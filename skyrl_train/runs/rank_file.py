"""A trainer rank's checkpoint file, ``policy_rank<r>.pt``: what it holds, and how it is
written and read without running pickled code.

A rank file is a ``torch.save`` of a dict of plain data only (tensors, numbers,
strings, None, and lists, tuples and dicts of them), read back with
``torch.load(weights_only=True)``. The folder's manifest (``runs/checkpoint.py``)
cannot stand in for that: it is an unsigned hash list that whoever hands over a
checkpoint folder can recompute, so a full unpickle of a shared or downloaded
checkpoint would run whatever code its author put in it, in every trainer rank.

Rank-file formats, told apart by ``RANK_FORMAT_KEY`` in the dict:

- 1 (no key): numpy's RNG state pickled as numpy objects, which only an unsafe load
  reads. Refused with ``CheckpointError``; ``scripts/convert_checkpoint.py`` converts
  a checkpoint whose source the user vouches for, the one place that unpickles.
- 2: plain data; the numpy and Python RNG states as a tensor and ints (``rng_state``).
  Files written since resharding also list where each parameter sits (``placement``,
  ``runs/reshard.py``) and resume under any layout; earlier ones under their own only.

What a rank file means for a resume (its layout, its backend) is ``runs/resume.py``'s;
this module knows only the file.
"""

from __future__ import annotations

import pickle
import random
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from skyrl_train.errors import CheckpointError
from skyrl_train.runs.checkpoint import RESUME_KEY
from skyrl_train.utils.durable import write_file

RANK_FORMAT_KEY = "rank_format_version"
RANK_FORMAT_VERSION = 2
CONVERT_SCRIPT = "scripts/convert_checkpoint.py"
SAVE_KEY = "trainer.ckpt_interval"
"""The config key a failed save names: the one that asked for checkpoints."""
PLAIN = "plain data: tensors, numbers, strings, None, lists, tuples and dicts"

# Not bytes: protocol 2 pickles b"" as a call of builtins.bytes, which weights_only refuses.
_LEAVES = (torch.Tensor, torch.nn.Parameter, bool, int, float, str, type(None))
_MT_WORDS = 624
"""MT19937's state words: the length of numpy's ``keys``."""


def checkpoint_file(folder: Path, rank: int) -> Path:
    return folder / f"policy_rank{rank}.pt"


# ---------------------------------------------------------------------------- saving


def save_rank_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` stamped with the current rank-file format, fsynced.

    Refuses, before writing anything, a value ``torch.load(weights_only=True)`` would
    not read back, naming where it sits: a module's ``_extra_state`` that is an object
    (Transformer Engine's ``io.BytesIO``; the local Megatron modules this trainer
    builds leave ``None`` there), or a new optimizer's non-tensor state.
    """
    stamped = {**state, RANK_FORMAT_KEY: RANK_FORMAT_VERSION}
    _require_plain(stamped, "state", path)
    write_file(path, lambda fh: torch.save(stamped, fh))


def _require_plain(value: Any, where: str, path: Path) -> None:
    kind = type(value)
    if kind in (list, tuple):
        for i, item in enumerate(value):
            _require_plain(item, f"{where}[{i}]", path)
    elif kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int):
                _refuse_save(path, f"{where} key {key!r}", key)
            _require_plain(item, f"{where}[{key!r}]", path)
        # A module state_dict carries per-module versions in its _metadata attribute,
        # which torch saves with the OrderedDict.
        for name, item in vars(value).items() if kind is OrderedDict else ():
            _require_plain(item, f"{where}.{name}", path)
    elif kind not in _LEAVES:
        # Exact types: a numpy scalar is a float subclass, and pickles as numpy's.
        _refuse_save(path, where, value)


def _refuse_save(path: Path, where: str, value: Any) -> NoReturn:
    kind = type(value)
    raise CheckpointError(
        SAVE_KEY,
        path,
        expected=f"a rank state of {PLAIN}, which torch.load(weights_only=True) reads back",
        got=f"{where}: a {kind.__module__}.{kind.__qualname__}",
    )


# --------------------------------------------------------------------------- loading


def read_rank_file(folder: Path, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s file of ``folder`` as a dict, read with
    ``torch.load(weights_only=True)`` (``mmap``: tensors mapped, read when used).

    Refuses, with a ``CheckpointError`` naming the file: a missing file, one holding
    pickled objects (a format-1 file named as such, with the conversion script), one
    torch cannot read, one that is not a dict, and one of another format version.
    """
    path = checkpoint_file(folder, rank)
    if not path.is_file():
        raise CheckpointError(
            RESUME_KEY, path, expected="one file per trainer rank", got="no such file"
        )
    try:
        state = read_plain(path, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # Not chained: torch's message advises re-running with weights_only=False,
        # the unsafe load this refusal exists to prevent.
        raise _pickled_objects(folder, path, str(exc)) from None
    except Exception as exc:
        raise CheckpointError(
            RESUME_KEY,
            path,
            expected="a rank state torch.load can read",
            got=f"{type(exc).__name__}: {exc}",
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            RESUME_KEY, path, expected="a dict of rank state", got=type(state).__name__
        )
    version = state.get(RANK_FORMAT_KEY)
    if version != RANK_FORMAT_VERSION:
        raise CheckpointError(
            RESUME_KEY,
            path,
            expected=f"{RANK_FORMAT_KEY} {RANK_FORMAT_VERSION}",
            got=f"{RANK_FORMAT_KEY} {version!r}",
        )
    return state


def read_plain(path: Path, *, map_location: str | None = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with torch's own allowlist only.

    Importing ``megatron.core`` adds numpy arrays, ``io.BytesIO``, ``PosixPath`` and
    more to the safe globals of every ``torch.load`` in the process: under it a
    format-1 file loaded, numpy objects and all. What a rank file may hold must not
    depend on what the process imported, so those are set aside for this one load
    (the trainer loads its rank file before any other thread uses torch.load).
    """
    extra = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    finally:
        torch.serialization.add_safe_globals(extra)


def _pickled_objects(folder: Path, path: Path, message: str) -> CheckpointError:
    """The refusal of a file ``torch.load(weights_only=True)`` would not unpickle;
    ``message`` is torch's, which names the first global it refused."""
    named = re.search(r"GLOBAL ([\w.]+)", message)
    found = named.group(1) if named else None
    expected = f"a rank file of format {RANK_FORMAT_VERSION} ({PLAIN})"
    convert = (
        f"if you trust where this checkpoint came from, convert it with "
        f"python {CONVERT_SCRIPT} --checkpoint {folder}"
    )
    if found is None:
        got = f"pickled objects torch.load(weights_only=True) refuses to load; {convert}"
    elif found.split(".")[0] == "numpy":
        got = (
            f"a format-1 rank file (no {RANK_FORMAT_KEY}; numpy's RNG state pickled as "
            f"{found}, which only an unsafe load reads); {convert}"
        )
    else:
        got = (
            f"a pickled {found}, which loading would call: not a rank file this trainer "
            "writes, refused unread"
        )
    return CheckpointError(RESUME_KEY, path, expected=expected, got=got)


# ------------------------------------------------------------------------ RNG states


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states as plain data (``RngState``
    reads it back)."""
    legacy: Any = np.random.get_state(legacy=True)  # MT19937's 5-tuple
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.random.get_rng_state(),
        "numpy": _numpy_fields(*legacy),
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }


def _numpy_fields(name: str, keys: Any, pos: int, has_gauss: int, gauss: float) -> dict[str, Any]:
    # int64: torch has no full uint32 support; every MT19937 word fits exactly.
    words = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    return {
        "bit_generator": str(name),
        "keys": words,
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(gauss),
    }


@dataclass(frozen=True)
class RngState:
    """The three RNG states of a rank file, checked and ready to restore."""

    torch_state: torch.Tensor
    numpy_state: tuple[Any, ...]
    python_state: tuple[Any, ...]

    @classmethod
    def read(cls, state: Mapping[str, Any], path: Path) -> RngState:
        """Check ``state["rng"]`` (as ``rng_state`` wrote it) without touching this
        process's generators; a bad field raises ``CheckpointError`` naming it."""
        rng = state.get("rng")
        if not isinstance(rng, dict):
            _bad_rng(path, "rng", "a dict of torch, numpy and python RNG states", rng)
        torch_state = rng.get("torch")
        size = torch.random.get_rng_state().shape
        if (
            not isinstance(torch_state, torch.Tensor)
            or torch_state.dtype != torch.uint8
            or torch_state.shape != size
        ):
            _bad_rng(path, "rng['torch']", f"a uint8 tensor of shape {list(size)}", torch_state)
        numpy_state = _numpy_tuple(rng.get("numpy"), path)
        python_state = _python_tuple(rng.get("python"), path)
        # Each library checks its own state on throwaway generators, so a bad field
        # fails here, before the caller restores anything.
        try:
            np.random.RandomState().set_state(numpy_state)
        except (TypeError, ValueError) as exc:
            _bad_rng(path, "rng['numpy']", "numpy's MT19937 state", str(exc))
        try:
            random.Random().setstate(python_state)
        except (TypeError, ValueError, OverflowError) as exc:
            _bad_rng(path, "rng['python']", "Python's random state", str(exc))
        return cls(torch_state=torch_state, numpy_state=numpy_state, python_state=python_state)

    def restore(self) -> None:
        torch.random.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)
        random.setstate(self.python_state)


def _numpy_tuple(fields: Any, path: Path) -> tuple[Any, ...]:
    where = "rng['numpy']"
    expected = f"a dict of MT19937 state fields with {_MT_WORDS} int64 keys in [0, 2**32)"
    if not isinstance(fields, dict):
        _bad_rng(path, where, expected, fields)
    keys = fields.get("keys")
    if (
        not isinstance(keys, torch.Tensor)
        or keys.dtype != torch.int64
        or keys.shape != (_MT_WORDS,)
        or bool((keys < 0).any())
        or bool((keys >= 2**32).any())
    ):
        _bad_rng(path, f"{where}['keys']", expected, keys)
    pos = fields.get("pos")
    # numpy's setter takes any position, though MT19937 only ever holds 0..624.
    if type(pos) is not int or not 0 <= pos <= _MT_WORDS:
        _bad_rng(path, f"{where}['pos']", f"an int in [0, {_MT_WORDS}]", repr(pos))
    return (
        fields.get("bit_generator"),
        keys.numpy().astype(np.uint32),
        pos,
        fields.get("has_gauss"),
        fields.get("cached_gaussian"),
    )


def _python_tuple(fields: Any, path: Path) -> tuple[Any, ...]:
    words = fields.get("state") if isinstance(fields, dict) else None
    if type(words) is not list or any(type(w) is not int for w in words):
        _bad_rng(path, "rng['python']['state']", "a list of ints", words)
    return (fields.get("version"), tuple(words), fields.get("gauss_next"))


def _bad_rng(path: Path, where: str, expected: str, got: Any) -> NoReturn:
    shown = got if isinstance(got, str) else type(got).__name__
    if isinstance(got, torch.Tensor):
        shown = f"a {got.dtype} tensor of shape {list(got.shape)}"
    raise CheckpointError(RESUME_KEY, path, expected=f"{where}: {expected}", got=shown)


# ------------------------------------------------------------------------ conversion


def upgrade_state(state: Any, path: Path) -> dict[str, Any]:
    """A format-1 rank state (already unpickled by the caller, who vouched for it)
    as format 2's plain data; a format-2 state comes back as it is. Changes no
    number: the model, optimizer, torch RNG, world size and layout are kept and the
    numpy and Python RNG states re-encoded exactly (``rng_state``'s encoding)."""
    key = "--checkpoint"
    if not isinstance(state, dict):
        raise CheckpointError(key, path, expected="a dict of rank state", got=type(state).__name__)
    version = state.get(RANK_FORMAT_KEY)
    if version == RANK_FORMAT_VERSION:
        return dict(state)
    if version is not None:
        raise CheckpointError(
            key, path, expected=f"{RANK_FORMAT_KEY} 1 (absent) or 2", got=f"{version!r}"
        )
    missing = [k for k in ("numpy_rng", "python_rng", "torch_rng") if k not in state]
    if missing:
        raise CheckpointError(
            key, path, expected="a format-1 rank state with its RNG states", got=f"no {missing}"
        )
    numpy_rng, python_rng = state["numpy_rng"], state["python_rng"]
    for name, value, size in (("numpy_rng", numpy_rng, 5), ("python_rng", python_rng, 3)):
        if not (isinstance(value, tuple) and len(value) == size):
            raise CheckpointError(
                key, path, expected=f"{name}: a {size}-tuple", got=type(value).__name__
            )
    rest = {k: v for k, v in state.items() if k not in ("numpy_rng", "python_rng", "torch_rng")}
    version_3, internal, gauss_next = python_rng
    return {
        **rest,
        "rng": {
            "torch": state["torch_rng"],
            "numpy": _numpy_fields(*numpy_rng),
            "python": {"version": version_3, "state": list(internal), "gauss_next": gauss_next},
        },
    }
