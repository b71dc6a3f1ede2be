"""A Hugging Face checkpoint folder: what is in it, checked before anything is built.

Every model the engine serves and the trainer trains is a folder: ``config.json``,
``*.safetensors``, tokenizer files and optionally ``generation_config.json``. The
built-in tiny model is no exception: ``builtin_checkpoint`` writes it once, as a real
folder under a cache keyed by its config and seed, and it is then read like any other.

``inspect_checkpoint`` reads only the small files (config, tokenizer, generation
config), so a launch can refuse a bad folder in about a second, before Ray starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import CheckpointFormatError
from inference.models.architecture import Family, MoEArchitecture
from inference.models.families import family_for

__all__ = [
    "CheckpointInfo",
    "builtin_checkpoint",
    "default_cache_dir",
    "inspect_checkpoint",
    "load_checkpoint_tokenizer",
    "read_config",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# The widest route dtype on the wire is int32 (inference.wire.fields.ROUTE_DTYPES).
_MAX_EXPERTS = int(np.iinfo(np.int32).max) + 1


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    family: Family
    architecture: MoEArchitecture
    hf_config: Any
    tokenizer: Any = field(repr=False, compare=False)
    """The folder's own tokenizer (``AutoTokenizer``), loaded once to check it."""
    eos_token_ids: tuple[int, ...]
    """From generation_config.json when it names any, else the tokenizer's EOS."""
    pad_token_id: int
    """The tokenizer's pad token, else the first EOS id."""

    @property
    def tokenizer_size(self) -> int:
        """``len(tokenizer)``: base vocabulary plus added tokens."""
        return len(self.tokenizer)


def _require_config(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointFormatError("folder", "an existing checkpoint folder", f"{path}: not found")
    if not (path / "config.json").is_file():
        raise CheckpointFormatError("config.json", f"a file in {str(path)!r}", "none")


def _require_folder(path: Path) -> None:
    _require_config(path)
    if not any(path.glob("*.safetensors")):
        raise CheckpointFormatError(
            "*.safetensors", f"weights as safetensors in {str(path)!r}", "none"
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointFormatError(
            "tokenizer", f"one of {list(_TOKENIZER_FILES)} in {str(path)!r}", "none"
        )


def load_checkpoint_tokenizer(folder: str | Path) -> Any:
    """The checkpoint's own tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    path = Path(folder)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError("tokenizer", "a tokenizer AutoTokenizer can load", exc) from exc


def _eos_ids(path: Path, tokenizer: Any) -> tuple[int, ...]:
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            value = json.loads(generation.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise CheckpointFormatError("generation_config.json", "valid JSON", exc) from exc
        ids = [value] if isinstance(value, int) else list(value or [])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointFormatError(
                "generation_config.json:eos_token_id", "an int or a list of ints", value
            )
        if ids:
            return tuple(ids)
    if tokenizer.eos_token_id is None:
        raise CheckpointFormatError(
            "tokenizer:eos_token",
            "an EOS token (or eos_token_id in generation_config.json)",
            None,
        )
    return (int(tokenizer.eos_token_id),)


def read_config(folder: str | Path) -> tuple[Any, Family, MoEArchitecture]:
    """A folder's ``config.json`` alone, as transformers reads it, with its family and
    architecture: a checkpoint's shapes without its tokenizer or weights, for checking a
    launch config against a model that is not on this machine
    (``skyrl_train.entrypoints.check_config``). Raises ``CheckpointFormatError`` as
    ``inspect_checkpoint`` does for the config's own faults."""
    from transformers import AutoConfig

    path = Path(folder)
    _require_config(path)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointFormatError("config.json", "a config transformers can read", exc) from exc
    family = family_for(hf_config)
    arch = family.describe(hf_config)
    if arch.num_experts > _MAX_EXPERTS:
        raise CheckpointFormatError(
            "config.json:num_experts",
            f"<= {_MAX_EXPERTS} (expert ids must fit int32, the widest route dtype)",
            arch.num_experts,
        )
    return hf_config, family, arch


def inspect_checkpoint(folder: str | Path) -> CheckpointInfo:
    """Reads and checks a checkpoint folder's small files; loads no weights.

    Raises ``CheckpointFormatError`` naming the file and field: a missing file, an
    ``architectures`` value no family supports (the message lists those that are),
    a config the family cannot map, a tokenizer larger than the embedding, EOS ids
    outside the vocabulary, or more experts than the widest route dtype holds.
    """
    path = Path(folder)
    _require_folder(path)
    hf_config, family, arch = read_config(path)
    tokenizer = load_checkpoint_tokenizer(path)
    size = len(tokenizer)
    if size > arch.vocab_size:
        raise CheckpointFormatError(
            "config.json:vocab_size",
            f">= the tokenizer's {size} tokens (ids past the embedding cannot be looked up)",
            arch.vocab_size,
        )
    eos = _eos_ids(path, tokenizer)
    bad = [i for i in eos if not 0 <= i < arch.vocab_size]
    if bad:
        raise CheckpointFormatError(
            "eos_token_id", f"ids in [0, {arch.vocab_size}) (config.json:vocab_size)", bad
        )
    pad = tokenizer.pad_token_id
    return CheckpointInfo(
        path=path,
        family=family,
        architecture=arch,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        pad_token_id=int(pad) if pad is not None else eos[0],
    )


def default_cache_dir() -> Path:
    """``$SKYRL_R3_CACHE``, else ``$XDG_CACHE_HOME/skyrl_r3``, else ``~/.cache/skyrl_r3``."""
    explicit = os.environ.get("SKYRL_R3_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skyrl_r3"


def builtin_checkpoint(config: Any, *, seed: int, cache_dir: str | Path | None = None) -> Path:
    """The built-in tiny model (a ``TinyMoEConfig``) as a checkpoint folder; written once.

    The folder name is a hash of the config, the seed and the transformers version
    (random init draws in module order, which a release may change), so a changed
    config never reuses stale weights. Written to a temporary sibling and renamed,
    so concurrent launches never see half a folder.
    """
    import transformers

    from inference.models.tiny_moe import build_hf_model
    from inference.models.tokenizer import save_byte_tokenizer

    key = json.dumps(
        {"config": config.to_dict(), "seed": seed, "transformers": transformers.__version__},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "builtin" / f"tiny-moe-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-moe-", dir=target.parent))
    try:
        model = build_hf_model(config, seed=seed)
        model.save_pretrained(str(staging))
        save_byte_tokenizer(staging)
        (staging / "builtin.json").write_text(key)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
