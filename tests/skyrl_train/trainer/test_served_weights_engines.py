"""The served-weights check on a real engine and trainer: issue 38's top-2 Mixtral
(``initializer_range`` 0.2) served in bf16 by the builtin engine on 127.0.0.1, scored
by an fp32 ``PolicyTrainer``, pushes through the real weight sync.

A flip of near-tie experts moves a whole probe when the trainer routes on its own,
over the bound that probe used to be held to alone; with the engine's routes replayed
the same probe is within a few hundredths, so the check the loop runs passes. Weights
of another checkpoint pushed to the engine are stopped either way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference.client import RemoteGenerateClient
from inference.models.architecture import TinySizes
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.server import EngineSpec, ServerConfig, ServerThread
from skyrl_train.config.compose import load_config
from skyrl_train.config.model_source import inspect_folder
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.prompts import load_datasets
from skyrl_train.errors import ServedWeightsError
from skyrl_train.generators.rendering import ChatTemplateRenderer
from skyrl_train.trainer.policy import PolicyTrainer, checkpoint_weights
from skyrl_train.trainer.served_weights import (
    PROBE_ROWS_SCANNED,
    EngineCheck,
    check_served_weights,
    probe_prompts,
)
from skyrl_train.trainer.weight_sync import WeightSyncer

KEY = "served-weights-test"
TOLERANCE = 0.1  # the default verify_weights_tolerance
MIXTRAL_TOP2 = TinySizes(num_experts_per_tok=2)
"""Issue 38's checkpoint: 6 experts, top-2, 3 layers, 48 wide, 6 heads of 8, init 0.2."""
SEED = 2
"""The checkpoint seed whose probes include one a flip moves over the bound on this
project's machine (0.18; scripts/bench_served_weights.py)."""


class Setup:
    def __init__(self, root: Path) -> None:
        self.folder = write_tiny_checkpoint("mixtral", root / "own", seed=SEED, sizes=MIXTRAL_TOP2)
        self.other = write_tiny_checkpoint(
            "mixtral", root / "other", seed=SEED + 1, sizes=MIXTRAL_TOP2
        )
        cfg = load_config([f"model.path={self.folder}", f"trainer.run_dir={root / 'run'}"])
        assert cfg.generator.inference_engine.enable_return_routed_experts  # R3 defaults
        assert cfg.trainer.policy.routing_replay.enabled
        info = inspect_folder(self.folder)
        self.pad = info.pad_token_id
        self.trainer = PolicyTrainer(cfg, checkpoint=str(self.folder), pad_token_id=self.pad)
        self.trainer.setup()
        renderer = ChatTemplateRenderer(info.tokenizer)
        rendered = [renderer.initial(t.prompt) for t in load_datasets(cfg).train]
        self.prompts = probe_prompts(iter(rendered))
        """What the loop probes with."""
        self.distinct = probe_prompts(iter(rendered[:PROBE_ROWS_SCANNED]))
        self.server = ServerThread(
            EngineSpec(checkpoint=str(self.folder), dtype="bfloat16").build,
            ServerConfig(api_key=KEY),
        )
        self.url = self.server.start()
        self.version = -1
        """The last version pushed: a server takes no older one than it serves."""

    async def score(self, batch: TrainingBatch) -> torch.Tensor:
        logprobs = self.trainer.score(batch)
        assert logprobs is not None  # one rank: the last pipeline stage
        return logprobs

    async def push_and_check(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        prompts: list[list[int]],
        routes: bool,
        tolerance: float = TOLERANCE,
    ) -> EngineCheck:
        self.version += 1
        version = self.version
        async with RemoteGenerateClient(self.url, api_key=KEY) as client:
            await WeightSyncer().push([client], weights, policy_version=version)
            (check,) = await check_served_weights(
                [client],
                [self.url],
                self.score,
                prompts=prompts,
                pad_token_id=self.pad,
                policy_version=version,
                tolerance=tolerance,
                routes=routes,
            )
        return check


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    torch.set_num_threads(1)
    made = Setup(tmp_path_factory.mktemp("served_weights_mixtral"))
    try:
        yield made
    finally:
        made.server.stop()


def test_a_healthy_bf16_mixtral_passes_with_routes_where_a_flip_failed_it_without(
    setup: Setup,
) -> None:
    own = setup.trainer.worker.export_weights
    # The launch's push of the trainer's own weights, checked as the loop does.
    check = asyncio.run(setup.push_and_check(own(), prompts=setup.prompts, routes=True))
    print(f"\nreplayed: probe medians {check.probe_medians}, mean {check.mean_abs_logp_diff}")
    assert check.replayed_routes and 0 < check.median_abs_logp_diff < TOLERANCE / 2
    # Each probe alone, as the old check held its one probe: unreplayed, a flip moves
    # one of them over the bound; replayed, the same probe is a few hundredths.
    alone = [
        asyncio.run(setup.push_and_check(own(), prompts=[p], routes=r, tolerance=math.inf))
        for p in setup.distinct
        for r in (False, True)
    ]
    unreplayed = [c.median_abs_logp_diff for c in alone[0::2]]
    replayed = [c.median_abs_logp_diff for c in alone[1::2]]
    print(f"one probe each: trainer routing {unreplayed}, replayed {replayed}")
    flipped = max(range(len(unreplayed)), key=unreplayed.__getitem__)
    assert unreplayed[flipped] > TOLERANCE, "expected a near-tie flip on this checkpoint"
    assert replayed[flipped] < TOLERANCE / 2
    with pytest.raises(ServedWeightsError, match="no routes: trainer routing"):
        asyncio.run(setup.push_and_check(own(), prompts=[setup.distinct[flipped]], routes=False))
    # Without routes (vLLM's CPU build), the median over all probes' tokens: the flip
    # moves one probe of several, and the check passes too.
    pooled = asyncio.run(setup.push_and_check(own(), prompts=setup.prompts, routes=False))
    assert not pooled.replayed_routes and pooled.median_abs_logp_diff < TOLERANCE / 2


@pytest.mark.parametrize("routes", [True, False])
def test_a_push_of_other_weights_is_stopped(setup: Setup, routes: bool) -> None:
    other = checkpoint_weights(setup.other)
    with pytest.raises(ServedWeightsError) as info:
        asyncio.run(setup.push_and_check(other, prompts=setup.prompts, routes=routes))
    err = info.value
    assert err.url == setup.url and err.policy_version == setup.version
    print(f"\n{err}")
    # Measured: 3.4 and more on every family (scripts/bench_served_weights.py).
    assert err.check.median_abs_logp_diff > 10 * TOLERANCE
    # The trainer's weights pushed back: the same engine passes again.
    back = setup.trainer.worker.export_weights()
    asyncio.run(setup.push_and_check(back, prompts=setup.prompts, routes=routes))
