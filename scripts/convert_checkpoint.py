"""Convert a trainer checkpoint whose rank files predate rank-file format 2 into one the
trainer resumes from.

    python scripts/convert_checkpoint.py --checkpoint runs/r3_grpo/checkpoints/step_000010 \\
        --trust-source [--out DIR | --in-place]

WARNING: this script unpickles the input's rank files (torch.load with
weights_only=False), which runs whatever code the files' author put in them, with
your permissions. The folder's manifest.json says nothing about who wrote it: anyone
who hands you a checkpoint can recompute it. Convert only checkpoints your own runs
wrote or whose source you trust; the script refuses to start without --trust-source.
It is the only place in the project that unpickles a checkpoint: the trainer reads
rank files with torch.load(weights_only=True) and refuses format-1 files.

Format-1 rank files (no rank_format_version) hold numpy's RNG state as pickled numpy
objects; the conversion re-encodes it and Python's RNG state as plain data and keeps
the model, optimizer and torch RNG states, the world size and the layout as they are
(skyrl_train/runs/rank_file.py). Rank files already in format 2 are copied
without unpickling; other files (driver.json) are copied byte for byte.

Output: a new committed checkpoint folder DIR/step_NNNNNN (the input's step) with its
own manifest, written aside and renamed into place as a trainer save is. DIR is --out,
by default a "converted" folder next to the input (for runs/x/checkpoints/step_000010:
runs/x/checkpoints/converted/step_000010, where checkpoint pruning never looks). The
input is never modified, unless --in-place: then the converted folder replaces the
input under its own name (the input is renamed aside, then deleted). Either way,
resume with trainer.resume_from=<the printed folder>.
"""

from __future__ import annotations

import argparse
import pickle
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from skyrl_train.errors import SkyRLTrainError  # noqa: E402
from skyrl_train.runs.checkpoint import (  # noqa: E402
    begin_save,
    checkpoint_name,
    commit_save,
    verify_checkpoint,
)
from skyrl_train.runs.rank_file import (  # noqa: E402
    RngState,
    checkpoint_file,
    read_plain,
    save_rank_state,
    upgrade_state,
)
from skyrl_train.runs.resume import load_rank_state  # noqa: E402
from skyrl_train.utils.durable import write_file  # noqa: E402

KEY = "--checkpoint"
RANK_FILE = re.compile(r"policy_rank(\d+)\.pt")


def convert(checkpoint: Path, out_root: Path) -> Path:
    """Write the converted copy of the committed ``checkpoint`` as
    ``out_root/step_NNNNNN`` and return it, read back as the trainer would."""
    found = verify_checkpoint(checkpoint, key=KEY)
    folder = begin_save(out_root, step=found.step)
    try:
        for record in found.files:
            source = checkpoint / record.name
            if RANK_FILE.fullmatch(record.name):
                save_rank_state(folder / record.name, upgrade_state(_unpickle(source), source))
            else:
                write_file(folder / record.name, source.read_bytes())
        final = commit_save(folder, step=found.step)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    written = verify_checkpoint(final, key=KEY)
    for rank in range(written.world_size):
        state = load_rank_state(final, rank=rank, world_size=written.world_size)
        RngState.read(state, checkpoint_file(final, rank))
    return final


def _unpickle(path: Path) -> object:
    try:
        return read_plain(path, map_location="cpu")
    except pickle.UnpicklingError:
        pass
    # The unsafe load the user vouched for with --trust-source.
    return torch.load(path, map_location="cpu", weights_only=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/convert_checkpoint.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="a committed step_NNNNNN folder"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        help="folder to write step_NNNNNN into (default: 'converted' next to the input)",
    )
    where.add_argument(
        "--in-place", action="store_true", help="replace the input folder with the conversion"
    )
    parser.add_argument(
        "--trust-source",
        action="store_true",
        help="you vouch for where the checkpoint came from: its rank files get unpickled",
    )
    args = parser.parse_args(argv)
    checkpoint: Path = args.checkpoint
    if not args.trust_source:
        parser.error(
            "--trust-source: expected your word that the checkpoint's source is trusted "
            "(converting unpickles its rank files, which can run any code in them), got none"
        )
    parent = checkpoint.resolve().parent
    out_root: Path = parent if args.in_place else (args.out or parent / "converted")
    if not args.in_place:
        if out_root.resolve() == parent:
            parser.error(
                f"--out: expected a folder other than the input's own ({parent}, where the "
                f"conversion would replace it; pass --in-place for that), got {args.out}"
            )
    try:
        step = verify_checkpoint(checkpoint, key=KEY).step
        target = out_root / checkpoint_name(step)
        if args.in_place and target != parent / checkpoint.resolve().name:
            parser.error(
                f"--in-place: expected a checkpoint folder named {target.name} (its step), "
                f"got {checkpoint.name}"
            )
        if not args.in_place and target.exists():
            parser.error(f"--out: expected no {target.name} in {out_root} yet, got one")
        final = convert(checkpoint, out_root)
    except (SkyRLTrainError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {final}")
    print(f"resume with trainer.resume_from={final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
