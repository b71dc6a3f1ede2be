"""What each trainer rank of a launch config would hold, and an estimate of its memory,
computed from the config and the model's architecture alone (no weights, no
megatron-core import): ``layout_report``, printed by ``entrypoints.check_config``.

Ranks follow megatron-core 0.16's ``initialize_model_parallel`` with its default order
``tp-cp-ep-dp-pp`` (the worker passes none): attention and embeddings sit on the grid
tp (fastest) x cp x dp x pp, the experts on etp x ep x expert-dp x pp, and both grids
share the pipeline rank, so global rank r has

    tp = r % TP, cp = r // TP % CP, dp = r // (TP CP) % DP, pp = r // (TP CP DP)
    etp = r % ETP, ep = r // ETP % EP, edp = r // (ETP EP) % EDP

(``tests/skyrl_train/config/test_presets.py`` checks these against megatron-core's own
``RankGenerator``). A stage holds layers in megatron's order: without virtual stages,
stage p the p-th contiguous block; with V virtual stages, chunk c of stage p holds block
c x PP + p of PP x V equal blocks. Experts: EP rank e holds the e-th contiguous
E / EP; heads and the (padded) vocabulary split the same way over TP.

Memory is counted as the Megatron worker allocates it (``workers/megatron``): fp32
weights (its TransformerConfig's ``params_dtype``), fp32 gradients, torch AdamW's two
fp32 moments, no separate master copy (the weights are fp32 already), one more fp32
copy of the rank's weights for the reference policy when it is kept (``trainer.ref``),
and the step's routes. Activations, the KV cache and allocator slack are not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from inference.models.architecture import MoEArchitecture
from inference.wire.fields import route_dtype_for
from skyrl_train.config.schema import PPOConfig

__all__ = ["LayoutReport", "RankLayout", "layout_report", "model_parameters"]

PARAM_BYTES = 4
"""fp32 weights: the worker builds its TransformerConfig with ``params_dtype=float32``."""
GRAD_BYTES = 4
ADAM_BYTES = 8
"""torch AdamW's ``exp_avg`` and ``exp_avg_sq``, fp32 like the weights."""

_GIB = 1 << 30


@dataclass(frozen=True)
class _Coords:
    """A trainer rank's coordinates: its rank in the tensor, context, data and pipeline
    groups, and in the expert-tensor, expert and expert-data groups."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    @classmethod
    def of(cls, r: int, *, tp: int, cp: int, dp: int, etp: int, ep: int, edp: int) -> _Coords:
        return cls(
            rank=r,
            tp=r % tp,
            cp=r // tp % cp,
            dp=r // (tp * cp) % dp,
            pp=r // (tp * cp * dp),
            etp=r % etp,
            ep=r // etp % ep,
            edp=r // (etp * ep) % edp,
        )


@dataclass(frozen=True)
class RankLayout(_Coords):
    """One trainer rank: its coordinates in megatron-core's groups and what it holds."""

    layers: tuple[int, ...]
    """Global 0-based decoder layers of its stage (every chunk's, in order)."""
    experts: range
    """Expert ids it holds in each MoE layer (each ``1 / etp`` of the expert's width)."""
    heads: range
    kv_heads: range
    vocab_rows: range | None
    """Its rows of the (padded) embedding or output layer; None on a middle stage."""
    sharded_params: int
    """Non-expert parameters split over TP (attention, dense and shared-expert MLPs,
    embedding and output rows): the same on every rank of its DP x CP group."""
    replicated_params: int
    """Parameters every TP rank of its stage holds whole: norms, routers, gates."""
    expert_params: int
    route_bytes: int
    """The routes of one step this rank receives (0 without routing replay)."""
    bytes_per_param: int
    """Weights, gradients, AdamW moments and the reference copy, per parameter."""

    @property
    def params(self) -> int:
        return self.sharded_params + self.replicated_params + self.expert_params

    @property
    def state_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.route_bytes


@dataclass(frozen=True)
class LayoutReport:
    """A launch config's layout, rank by rank, and its memory estimate."""

    strategy: str
    """``trainer.strategy``: under FSDP every rank holds a 1/world shard of everything."""
    family: str
    total_params: int
    """The checkpoint's parameter count (its vocabulary, unpadded; tied weights once)."""
    world: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    padded_vocab: int
    keeps_reference: bool
    trajectories_per_rank: int
    tokens_per_trajectory: int
    route_dtype: str
    ranks: tuple[RankLayout, ...]

    @property
    def max_rank_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    def render(self) -> str:
        """The report as ``check_config`` prints it."""
        vpp = f" VPP={self.vpp}" if self.vpp else ""
        ref = "+ 4 (reference copy) " if self.keeps_reference else ""
        layout = (
            f"layout: {self.world} ranks = TP={self.tp} x CP={self.cp} x DP={self.dp} x "
            f"PP={self.pp}{vpp}; experts: ETP={self.etp} x EP={self.ep} x EDP={self.edp} "
            f"x PP={self.pp} (megatron-core order tp-cp-ep-dp-pp)"
        )
        if self.strategy == "fsdp":
            layout = f"layout: FSDP, {self.world} ranks each a 1/{self.world} of every parameter"
        lines = [
            f"model: {self.family}, {_count(self.total_params)} parameters",
            layout,
            f"vocabulary rows: {self.padded_vocab} (padded for TP)",
            "memory assumptions: fp32 weights 4 + gradients 4 + AdamW moments 8 "
            f"{ref}bytes per parameter (no master copy: the weights are fp32); routes: "
            f"{self.trajectories_per_rank} trajectories a rank x {self.tokens_per_trajectory} "
            f"tokens x MoE layers x top-k x {self.route_dtype}; activations, KV cache and "
            "allocator slack not counted",
            "",
            f"{'rank':>4} {'tp cp dp pp':>11} {'etp ep edp':>10}  {'layers':<12} "
            f"{'experts':<9} {'heads':<9} {'params':>8} {'weights':>8} {'grads':>7} "
            f"{'adam':>7} {'ref':>7} {'routes':>7} {'total':>8}",
            f"{'':>4} {'':>11} {'':>10}  {'':<12} {'':<9} {'':<9} {'':>8} {'GiB':>8} "
            f"{'GiB':>7} {'GiB':>7} {'GiB':>7} {'MiB':>7} {'GiB':>8}",
        ]
        for r in self.ranks:
            ref_bytes = r.params * PARAM_BYTES if self.keeps_reference else 0
            lines.append(
                f"{r.rank:>4} {r.tp:>2} {r.cp:>2} {r.dp:>2} {r.pp:>2} "
                f"{r.etp:>3} {r.ep:>2} {r.edp:>3}  {_span(r.layers):<12} "
                f"{_range(r.experts):<9} {_range(r.heads):<9} {_count(r.params):>8} "
                f"{_gib(r.params * PARAM_BYTES):>8} {_gib(r.params * GRAD_BYTES):>7} "
                f"{_gib(r.params * ADAM_BYTES):>7} {_gib(ref_bytes):>7} "
                f"{r.route_bytes / (1 << 20):>7.1f} {_gib(r.total_bytes):>8}"
            )
        lines.append(f"\nlargest rank: {_gib(self.max_rank_bytes)} GiB before activations")
        return "\n".join(lines)


def model_parameters(arch: MoEArchitecture) -> int:
    """The checkpoint's parameter count from its architecture."""
    whole = _Shapes(arch, vocab=arch.vocab_size)
    embeddings = whole.vocab * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    layers = sum(whole.layer(i, tp=1, ep=1, etp=1) for i in range(arch.num_layers))
    return embeddings + layers + arch.hidden_size  # + the final norm


def layout_report(cfg: PPOConfig, arch: MoEArchitecture, *, prompt_tokens: int = 0) -> LayoutReport:
    """Every trainer rank of ``cfg`` on ``arch``; ``prompt_tokens``: the prompt length
    the route estimate adds to ``generator.max_response_tokens`` per trajectory."""
    tr = cfg.trainer
    world = tr.placement.num_trainers
    if tr.strategy == "megatron":
        mc = tr.policy.megatron_config
        tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
        cp, ep = mc.context_parallel_size, mc.expert_model_parallel_size
        etp, vpp = mc.expert_tensor_parallel_size or tp, mc.virtual_pipeline_model_parallel_size
        multiple = mc.make_vocab_size_divisible_by * tp
    else:  # FSDP: data parallel only, every rank a 1/world shard of every parameter
        tp = pp = cp = ep = etp = multiple = 1
        vpp = None
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    # megatron-core's padding rule (workers/megatron/model.padded_vocab_size, which sits
    # behind a megatron-core import: seconds here).
    shapes = _Shapes(arch, vocab=-(-arch.vocab_size // multiple) * multiple)
    keeps_ref = tr.ref.log_kl or tr.algorithm.use_kl_loss
    per_param = PARAM_BYTES + GRAD_BYTES + ADAM_BYTES + (PARAM_BYTES if keeps_ref else 0)
    trajectories = tr.train_batch_size * cfg.generator.n_samples_per_prompt // dp
    tokens = prompt_tokens + cfg.generator.max_response_tokens
    dtype = route_dtype_for(arch.num_experts - 1)
    replay = tr.policy.routing_replay.enabled
    # Every rank gets routes for every MoE layer, its stage's or not (replay.py).
    routes = trajectories * tokens * arch.num_moe_layers * arch.num_experts_per_tok
    route_bytes = routes * dtype.itemsize if replay else 0
    ranks = []
    for r in range(world):
        c = _Coords.of(r, tp=tp, cp=cp, dp=dp, etp=etp, ep=ep, edp=edp)
        layers = _stage_layers(arch.num_layers, pp=pp, vpp=vpp, stage=c.pp)
        sharded, replicated, experts = shapes.stage(
            layers, stage=c.pp, pp=pp, tp=tp, ep=ep, etp=etp
        )
        if tr.strategy != "megatron":
            sharded, replicated, experts = -(-(sharded + replicated + experts) // world), 0, 0
        first, last = c.pp == 0, c.pp == pp - 1
        rows = shapes.vocab // tp
        local_experts = arch.num_experts // ep
        ranks.append(
            RankLayout(
                **dataclasses.asdict(c),
                layers=layers,
                experts=range(c.ep * local_experts, (c.ep + 1) * local_experts),
                heads=_share(arch.num_attention_heads, tp, c.tp),
                kv_heads=_share(arch.num_kv_heads, tp, c.tp),
                vocab_rows=range(c.tp * rows, (c.tp + 1) * rows) if first or last else None,
                sharded_params=sharded,
                replicated_params=replicated,
                expert_params=experts,
                route_bytes=route_bytes,
                bytes_per_param=per_param,
            )
        )
    return LayoutReport(
        strategy=tr.strategy,
        family=arch.family,
        total_params=model_parameters(arch),
        world=world,
        tp=tp,
        pp=pp,
        vpp=vpp,
        cp=cp,
        ep=ep,
        etp=etp,
        dp=dp,
        edp=edp,
        padded_vocab=shapes.vocab,
        keeps_reference=keeps_ref,
        trajectories_per_rank=trajectories,
        tokens_per_trajectory=tokens,
        route_dtype=str(dtype),
        ranks=tuple(ranks),
    )


@dataclass(frozen=True)
class _Shapes:
    """Parameter counts of ``arch``'s pieces, as megatron-core splits them."""

    arch: MoEArchitecture
    vocab: int

    def layer(self, i: int, *, tp: int, ep: int, etp: int) -> int:
        sharded, replicated, experts = self.layer_parts(i, tp=tp, ep=ep, etp=etp)
        return sharded + replicated + experts

    def layer_parts(self, i: int, *, tp: int, ep: int, etp: int) -> tuple[int, int, int]:
        a = self.arch
        h, hd = a.hidden_size, a.head_dim
        q, kv = a.num_attention_heads * hd, a.num_kv_heads * hd
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if a.qkv_bias else 0)
        qk_norm = {"none": 0, "per_head": 2 * hd, "full": q + kv}[a.qk_norm]
        replicated = 2 * h + qk_norm  # the two RMSNorms' weights
        sharded, experts = attention // tp, 0
        if i in a.moe_layers:
            replicated += a.num_experts * h  # the router
            width = a.moe_ffn_hidden_size // etp
            experts = a.num_experts // ep * 3 * h * width  # gated fc1 (2 x width) + fc2
            if a.shared_expert_ffn_hidden_size:
                sharded += 3 * h * a.shared_expert_ffn_hidden_size // tp
                replicated += h  # the shared expert's sigmoid gate
        else:
            sharded += 3 * h * a.dense_ffn_hidden_size // tp
        return sharded, replicated, experts

    def stage(
        self, layers: tuple[int, ...], *, stage: int, pp: int, tp: int, ep: int, etp: int
    ) -> tuple[int, int, int]:
        sharded = replicated = experts = 0
        for i in layers:
            s, r, e = self.layer_parts(i, tp=tp, ep=ep, etp=etp)
            sharded, replicated, experts = sharded + s, replicated + r, experts + e
        rows = self.vocab // tp * self.arch.hidden_size
        if stage == 0:
            sharded += rows
        if stage == pp - 1:
            replicated += self.arch.hidden_size  # the final norm
            # Tied weights: megatron keeps a copy of the embedding on the last stage.
            if not self.arch.tie_word_embeddings or pp > 1:
                sharded += rows
        return sharded, replicated, experts


def _stage_layers(num_layers: int, *, pp: int, vpp: int | None, stage: int) -> tuple[int, ...]:
    chunks = vpp or 1
    size = num_layers // (pp * chunks)
    return tuple(
        layer
        for chunk in range(chunks)
        for layer in range((chunk * pp + stage) * size, (chunk * pp + stage + 1) * size)
    )


def _share(total: int, parts: int, index: int) -> range:
    size = total // parts
    return range(index * size, (index + 1) * size)


def _span(layers: tuple[int, ...]) -> str:
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    if len(layers) <= 3:
        return ",".join(str(i) for i in layers)
    return f"{layers[0]},{layers[1]},..,{layers[-1]}"  # interleaved chunks


def _range(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f}"
