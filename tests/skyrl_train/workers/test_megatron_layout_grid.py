"""The layout grid on 8 gloo processes: every family of layouts launch validation accepts
(``megatron_rules.check_megatron``: by rule, not by list) against the single-rank
reference, on the test model with room for them (``LAYOUT_TEST_MODEL``: 8 heads, 4 KV
heads, 8 experts at top-2, 8 layers; ``LAYOUT_TEST_SIZES`` for the HF families).

Each case is ``_layout_checks.run_case``: R3 forward and train step, the R2 step, the
bounds of issue 39 (log-probs 1e-5, loss and gradient norm 1e-5 relative, clipped
gradients element by element, the weights after one step within 1e-5 where the gradient
is at least 1e-6, agreement 1.0), and this rank's route shard swapped for another
rank's (sequence slice, pipeline stage or data-parallel rows) must fail. As in the
2-rank test the reference runs in the same group, every rank given the same whole batch
(8 data-parallel replicas of one rank: their averaged gradient is that rank's), so DP=8
is the reference's own layout and each grid row changes the data-parallel size too.

One 8-rank launch runs the whole grid (start-up, ~40 s of 8 interpreters importing
torch and megatron-core on 2 cores, is paid once); rank 0 writes each case's worst
differences, which the test prints as the table docs/parallel-layouts.md shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from _layout_checks import (
    TOL,
    check_resumed,
    checkpoint,
    close,
    compare,
    resume_elsewhere,
    run_case,
)
from _ranks import run_group

from inference.models.architecture import LAYOUT_TEST_SIZES
from inference.models.tiny_moe import LAYOUT_TEST_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 8
ALLTOALL = {"transformer_config_kwargs": {"moe_token_dispatcher_type": "alltoall"}}
TP, PP, VPP = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    ("virtual_pipeline_model_parallel_size"),
)
EP, ETP = "expert_model_parallel_size", "expert_tensor_parallel_size"
SLIME = {TP: 4, EP: 8, ETP: 1}
"""slime's Qwen3-30B-A3B layout: attention TP=4 (sequence parallel) x DP=2, experts EP=8
whole on their rank (megatron-core's MoE parallel folding)."""
# Layout -> (settings, the checkpoints it runs). The slime shape runs every family that
# allows TP; OLMoE (its q/k norm spans every head, so TP=1) runs the pipeline and the
# expert-parallel rows; the rest run the built-in model. The suite runs SUITE's rows, one
# of each family of layouts, in 2-3 minutes; the whole grid (about 4x that on 2 cores)
# is a by-hand check (scripts/by_hand_checks.sh).
GRID: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "TP=4 x DP=2": ({TP: 4}, ("builtin",)),
    "TP=2 x EP=4 (ETP=1) x DP=4": ({TP: 2, EP: 4, ETP: 1}, ("builtin",)),
    "TP=2 x EP=2 x ETP=2 x DP=2": ({TP: 2, EP: 2}, ("builtin",)),
    "TP=4 x EP=8 (ETP=1) x DP=2": (SLIME, ("builtin", "qwen3_moe", "qwen2_moe", "mixtral")),
    "TP=4 x EP=8 (ETP=1), alltoall": ({**SLIME, **ALLTOALL}, ("builtin",)),
    "EP=8, alltoall": ({EP: 8, **ALLTOALL}, ("builtin", "olmoe")),
    "PP=4 x DP=2": ({PP: 4}, ("builtin", "olmoe")),
    "PP=2 x DP=4": ({PP: 2}, ("builtin",)),
    "PP=2 x TP=2 x EP=2 (ETP=1) x DP=2": ({PP: 2, TP: 2, EP: 2, ETP: 1}, ("builtin",)),
    "PP=2 x TP=2 x EP=2 (ETP=1), alltoall": ({PP: 2, TP: 2, EP: 2, ETP: 1, **ALLTOALL}, ("builtin",)),
    "PP=2 x VPP=2 x EP=2 x DP=4": ({PP: 2, VPP: 2, EP: 2}, ("builtin",)),
    "PP=4 x VPP=2 x DP=2": ({PP: 4, VPP: 2}, ("builtin",)),
}  # fmt: skip
SUITE = (
    "TP=2 x EP=2 x ETP=2 x DP=2",
    "TP=4 x EP=8 (ETP=1) x DP=2",
    "PP=2 x TP=2 x EP=2 (ETP=1), alltoall",
    "PP=2 x VPP=2 x EP=2 x DP=4",
    "PP=4 x VPP=2 x DP=2",
)
"""The rows the suite runs, on the built-in model: TP=4 with MoE parallel folding and
DP, ETP = TP, a pipeline with TP x EP on the alltoall dispatcher, VPP with EP, PP=4."""
PACKED_ROWS = ("PP=2 x TP=2 x EP=2 (ETP=1), alltoall", "PP=2 x VPP=2 x EP=2 x DP=4")
"""Rows the suite also runs packed (``trainer.remove_microbatch_padding``; R3 forward and
step on the built-in model): a pipeline's one length, SP's multiple and the expert
exchange's all-reduce of the packed lengths together (the 2-rank layouts run in
``test_megatron_tensor_parallel.py``)."""
CHECKPOINTS = ("builtin", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
RESUMES = {
    # The expert tensor size alone changes (the file's recorded ETP sends it to the
    # reshard; before ETP was recorded, a resume read its own file and died on torch's
    # size mismatch after copying what fit).
    "TP=2 x EP=2 x ETP=2 x DP=2": {TP: 2, EP: 2, ETP: 1},
    # Every size changes: TP 4 -> 1, EP 8 -> 1, PP 1 -> 4 with 2 virtual stages.
    "TP=4 x EP=8 (ETP=1) x DP=2": {PP: 4, VPP: 2},
}
"""The built-in model's checkpoint after the row's step -> the layout it resumes under."""


def _rank_main(rank: int, out: str, rows: tuple[str, ...], names: tuple[str, ...]) -> None:
    worst: dict[str, dict[str, float]] = {}
    for name in names:
        arch, hf_state = checkpoint(name, model=LAYOUT_TEST_MODEL, sizes=LAYOUT_TEST_SIZES)
        ref = run_case(arch, {}, hf_state)
        for layout in rows:
            settings, cases = GRID[layout]
            if name not in cases:
                continue
            got = run_case(arch, settings, hf_state)
            worst[f"{name}: {layout}"] = compare(f"{name} {layout}", rank, hf_state, ref, got)
            if name == "builtin" and layout in PACKED_ROWS:
                packed = run_case(arch, settings, hf_state, r3_only=True, packed=True)
                assert packed["attention"] == "PackedDotProductAttention", layout
                worst[f"packed: {layout}"] = compare(
                    f"packed {layout}", rank, hf_state, ref, packed
                )
            if name == "builtin" and layout in RESUMES:
                folder = Path(out).parent / f"resume {layout}"
                folder.mkdir(exist_ok=True)
                sides = resume_elsewhere(
                    got, arch, source=settings, target=RESUMES[layout], folder=folder,
                    rank=rank, world=WORLD,
                )  # fmt: skip
                check_resumed(f"resume {layout}", sides)
                worst[f"resumed: {layout}"] = {"logprobs": close(
                    sides["got_next"]["logprobs"], sides["want_next"]["logprobs"]
                )}  # fmt: skip
            del got  # the worker: its memory before the next layout's
    if rank == 0:
        Path(out).write_text(json.dumps(worst, indent=1), encoding="utf-8")


def test_each_family_of_layouts_gives_the_one_rank_numbers(tmp_path: Path) -> None:
    _run_grid(tmp_path, SUITE, ("builtin",))


@pytest.mark.by_hand
@pytest.mark.timeout(2400)  # 12 rows in 5 families: ~4x the suite's share
def test_every_layout_of_the_grid_in_every_family_gives_the_one_rank_numbers(
    tmp_path: Path,
) -> None:
    _run_grid(tmp_path, tuple(GRID), CHECKPOINTS)


def _run_grid(tmp_path: Path, rows: tuple[str, ...], names: tuple[str, ...]) -> None:
    out = tmp_path / "worst.json"
    args = (str(out), rows, names)
    run_group(_rank_main, args=args, nprocs=WORLD, rendezvous=tmp_path / "rendezvous")
    worst = json.loads(out.read_text(encoding="utf-8"))
    want = {f"{n}: {layout}" for layout in rows for n in GRID[layout][1] if n in names}
    resumed = {f"resumed: {layout}" for layout in RESUMES if layout in rows}
    packed = {
        f"packed: {layout}" for layout in PACKED_ROWS if layout in rows and "builtin" in names
    }
    assert set(worst) == want | resumed | packed
    for case in resumed:
        # Resharded bit for bit (checked in every rank); scored as the saved worker.
        assert worst.pop(case)["logprobs"] <= TOL, case
    for case, row in worst.items():
        # Checked in every rank already; here so the table cannot claim what failed.
        assert max(row["logprobs"], row["entropy"], row["grads"], row["weights"]) <= TOL, case
        assert row["loss"] <= TOL and row["grad_norm"] <= TOL, case
        if case not in packed:  # the packed case runs no swapped shard
            assert not math.isnan(row["swapped"]) and row["swapped"] < 0.5, case
        print(
            f"| {case} | {row['logprobs']:.1e} | {row['loss']:.1e} | {row['grad_norm']:.1e} | "
            f"{row['weights']:.1e} | {row['swapped']:.3f} |"
        )
