"""Hugging Face folders of the trained model, written aside, fsynced, renamed into place.

Layout under ``trainer.export_path`` (null: ``<run_dir>/exports``)::

    global_step_10/                 finished: a global_step_* folder only ever appears whole
        model.safetensors           or model-0000i-of-0000N.safetensors shards and
                                    model.safetensors.index.json, above max_shard_bytes
        config.json                 the input checkpoint's, byte for byte
        generation_config.json      the input's, with its EOS ids filled in
        tokenizer.json ...          the input's tokenizer files and chat template, copied
        skyrl_export.json           written last: the step, the run, every file and size
    global_step_20.tmp-1a2b3c4d/    an export in progress, or one a crash cut short:
                                    never listed, removed by the next export

An export is ``begin_export`` (checks the target, removes stale temp folders, makes a
fresh one), ``write_weights`` on the one process that holds the whole model's stream
(trainer rank 0; the other ranks consume the stream in lockstep), then
``commit_export``: the small files, the marker, an fsync of the folder and a rename.
Every file goes through ``utils.durable.write_file`` (fsynced) before the rename makes
the folder visible. ``config.json`` is written after the weights and the tokenizer, so a
temp folder cut short before it is no model folder anything could load.

Weights are written in the layout ``save_pretrained`` writes (what vLLM and the Hub
read), not the live modules' names the trainer streams: transformers 5 fuses each
layer's experts into ``mlp.experts.gate_up_proj`` when it loads and splits them again
when it saves. The same reversal (``revert_weight_conversion``) runs here layer by layer,
on a model built on the meta device, so no second copy of the weights is made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyrl_train.errors import ConfigValidationError
from skyrl_train.utils.durable import fsync_dir, rename_into_place, temp_sibling, write_file

EXPORTS_DIR = "exports"
MARKER_FILE = "skyrl_export.json"
FORMAT = "skyrl-r3-hf-export"
FORMAT_VERSION = 1
EXPORT_KEY = "trainer.export_path"
EXPORT_DIR = re.compile(r"global_step_(\d+)")
TEMP_DIR = re.compile(r"(.+)\.tmp-[0-9a-f]{8}")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""The shard size most Hub checkpoints use (transformers 4.x's default; 5.x's is 50 GB):
a shard is what the writer holds in memory, and what a reader fetches in one piece."""
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files a tokenizer and its chat template may be stored in; those the input
folder has are copied as they are, so ids and renderings cannot drift."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^(model\.layers\.\d+)\.")

OnFile = Callable[[Path], None]
"""Called with each file once it is on disk (progress lines; tests stop a writer here)."""


@dataclass(frozen=True)
class WeightFiles:
    """What ``write_weights`` wrote."""

    files: tuple[str, ...]
    """The weight files (and the index, when sharded), in the order written."""
    tensors: int
    total_bytes: int


def export_name(step: int) -> str:
    return f"global_step_{step}"


def export_root(export_path: str | None, run_dir: str | Path) -> Path:
    """``trainer.export_path``, or ``<run_dir>/exports`` when it is null."""
    return Path(export_path) if export_path is not None else Path(run_dir) / EXPORTS_DIR


def export_due(step: int, *, interval: int, num_steps: int) -> bool:
    """``trainer.hf_save_interval``: -1 never, 0 at the last step only, N > 0 every N
    steps and at the last one (SkyRL's key; the model a run ends with is its point)."""
    if interval < 0:
        return False
    return step == num_steps or (interval > 0 and step % interval == 0)


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's ``skyrl_export.json`` if it is one this module wrote, else None."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == FORMAT else None


def list_exports(root: Path) -> list[tuple[int, Path]]:
    """Finished exports under ``root`` by step: ``global_step_N`` folders (no symlinks)
    holding the marker. Temp folders never match the name, so are never listed."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = EXPORT_DIR.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and read_marker(path) is not None:
            found.append((int(match.group(1)), path))
    return sorted(found)


def remove_stale_exports(parent: Path, name: str) -> list[Path]:
    """Remove temp folders under ``parent`` of ``name`` or of any ``global_step_N``
    (an export a crash cut short, or a replaced one set aside); returns them."""
    stale = []
    for path in sorted(parent.iterdir()):
        match = TEMP_DIR.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink():
            base = match.group(1)
            if base == name or EXPORT_DIR.fullmatch(base):
                stale.append(path)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# ---------------------------------------------------------------------------- writing


def check_target(final: Path, *, key: str) -> None:
    """Refuse writing ``final`` unless it is new, an empty folder, or an export (which a
    new one replaces): a model folder or anything else there is the user's."""
    if not final.exists() and not final.is_symlink():
        return
    if final.is_symlink() or not final.is_dir():
        raise ConfigValidationError(
            key, expected="a folder to write the export into", got=f"{str(final)!r}, a file"
        )
    names = sorted(p.name for p in final.iterdir())
    if names and read_marker(final) is None:
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ConfigValidationError(
            key,
            expected=f"a new or empty folder, or an earlier export (which holds {MARKER_FILE})",
            got=f"{str(final)!r}, which holds {listed}",
        )


def begin_export(final: Path, *, key: str = EXPORT_KEY) -> Path:
    """A fresh temp folder beside ``final`` to write the export into."""
    final = Path(final)
    check_target(final, key=key)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(final.parent, final.name)
    temp = temp_sibling(final)
    temp.mkdir()
    return temp


def write_weights(
    folder: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source: Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_file: OnFile | None = None,
) -> WeightFiles:
    """Write the streamed weights (the live modules' names, ``export_weights()``) into
    ``folder`` in ``source``'s on-disk layout and dtype (its config.json's ``dtype``),
    as one ``model.safetensors`` or, past ``max_shard_bytes``, shards and an index.

    At most one shard is held in memory (twice, while it is serialised); a tensor larger
    than the limit gets a shard of its own. A name that comes twice raises ValueError.
    """
    from safetensors.torch import save

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected a positive int, got {max_shard_bytes}")
    config = json.loads((source / "config.json").read_bytes())
    dtype = _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.float32)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = count = 0
    parts: list[Path] = []
    owner: dict[str, int] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        part = folder / f"part-{len(parts) + 1:05d}.safetensors"
        write_file(part, save(shard, metadata={"format": "pt"}))
        parts.append(part)
        shard, shard_bytes = {}, 0

    for name, tensor in _on_disk(tensors, source):
        if name in owner:
            raise ValueError(f"{name}: expected each weight once in the stream, got it twice")
        tensor = tensor.detach().to(dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor
        owner[name] = len(parts)
        shard_bytes += size
        total += size
        count += 1
    flush()
    if not parts:
        raise ValueError("tensors: expected the model's weights, got an empty stream")
    # Shard names carry the shard count, known only now: renamed inside the temp folder.
    names = (
        [WEIGHTS_FILE]
        if len(parts) == 1
        else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    )
    for part, final_name in zip(parts, names, strict=True):
        os.rename(part, folder / final_name)
        if on_file is not None:
            on_file(folder / final_name)
    written = list(names)
    if len(parts) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: names[owner[n]] for n in sorted(owner)},
        }
        write_file(folder / INDEX_FILE, json.dumps(index, indent=2).encode() + b"\n")
        written.append(INDEX_FILE)
        if on_file is not None:
            on_file(folder / INDEX_FILE)
    fsync_dir(folder)
    return WeightFiles(files=tuple(written), tensors=count, total_bytes=total)


def commit_export(
    folder: Path,
    final: Path,
    *,
    source: Path,
    step: int | None,
    run_dir: str | Path | None = None,
    key: str = EXPORT_KEY,
    on_file: OnFile | None = None,
) -> Path:
    """Copy ``source``'s tokenizer files and chat template, write its generation config
    (EOS ids filled in) and config.json, then the marker, and rename ``folder`` (a
    ``begin_export`` folder holding the weights) to ``final``; returns ``final``.

    An export already at ``final`` is first renamed aside as a temp folder (removed
    after, or by the next export): a crash between the two renames leaves no
    ``final``, never a mix of two exports.
    """
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: expected the weights written (write_weights) first")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            _write(folder / name, (source / name).read_bytes(), on_file)
    _write(folder / GENERATION_FILE, _generation_config(source), on_file)
    _write(folder / "config.json", (source / "config.json").read_bytes(), on_file)
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "source": str(source.resolve()),
        "run_dir": str(Path(run_dir).resolve()) if run_dir is not None else None,
        "files": [{"name": p.name, "size": p.stat().st_size} for p in sorted(folder.iterdir())],
    }
    write_file(folder / MARKER_FILE, json.dumps(marker, indent=1).encode() + b"\n")
    fsync_dir(folder)
    check_target(final, key=key)  # nothing of the user's appeared there meanwhile
    # An empty folder at final is renamed over, not set aside.
    aside = temp_sibling(final) if final.is_dir() and any(final.iterdir()) else None
    rename_into_place(folder, final, aside=aside)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def write_hf_export(
    final: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source: Path,
    step: int | None,
    key: str = EXPORT_KEY,
    run_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_file: OnFile | None = None,
) -> Path:
    """``begin_export``, ``write_weights`` and ``commit_export`` in one process; a
    failure removes the temp folder (a crash leaves it for the next export to remove)."""
    temp = begin_export(Path(final), key=key)
    try:
        write_weights(
            temp, tensors, source=source, max_shard_bytes=max_shard_bytes, on_file=on_file
        )
        return commit_export(
            temp, Path(final), source=source, step=step, run_dir=run_dir, key=key, on_file=on_file
        )
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- helpers


def _write(path: Path, data: bytes, on_file: OnFile | None) -> None:
    write_file(path, data)
    if on_file is not None:
        on_file(path)


def _generation_config(source: Path) -> bytes:
    """``source``'s generation_config.json (or a new one) naming its EOS ids: the
    tokenizer's EOS when the file names none, as the engine reads them."""
    from inference.models.checkpoint import load_checkpoint_tokenizer

    path = source / GENERATION_FILE
    config: dict[str, Any] = json.loads(path.read_bytes()) if path.is_file() else {}
    if config.get("eos_token_id") in (None, []):
        tokenizer = load_checkpoint_tokenizer(source)
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{source}: expected an EOS token in the tokenizer or {GENERATION_FILE}, got none"
            )
        config["eos_token_id"] = int(tokenizer.eos_token_id)
        if config.get("pad_token_id") is None and tokenizer.pad_token_id is not None:
            config["pad_token_id"] = int(tokenizer.pad_token_id)
    return json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"


def _on_disk(
    tensors: Iterable[tuple[str, torch.Tensor]], source: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream under save_pretrained's names: each decoder layer's tensors (which
    the stream yields together) are reverted as one group, other tensors one by one."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    group: dict[str, torch.Tensor] = {}
    prefix: str | None = None
    for name, tensor in tensors:
        match = _LAYER.match(name)
        here = match.group(1) if match else None
        if group and (here is None or here != prefix):
            yield from revert_weight_conversion(meta, group).items()
            group = {}
        if here is None:
            yield from revert_weight_conversion(meta, {name: tensor}).items()
        else:
            if name in group:
                raise ValueError(f"{name}: expected each weight once in the stream, got it twice")
            group[name] = tensor
            prefix = here
    if group:
        yield from revert_weight_conversion(meta, group).items()
