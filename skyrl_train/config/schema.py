"""The config schema: one dataclass per node of ``configs/ppo_base_config.yaml``.

Registered with Hydra's ConfigStore (``config.compose``), so composition itself
refuses an unknown key or a wrong type, naming the dotted key, ``--cfg job``
included. Range and choice rules sit beside each field (``setting``, checked by
``constraints.check_constraints``); checks across fields (divisibility, R3
compatibility) are run by ``validate.validate_cfg``, from the rule modules beside it
(``validate.py``'s docstring lists them). Defaults here equal the YAML's (a test pins
that), so a config built in Python and a launch that reads the YAML see the same run.

The dataclasses are not frozen: OmegaConf makes a frozen dataclass's node read-only,
and then the YAML cannot be merged into it.

Key names follow SkyRL where SkyRL has one, so launch scripts carry over.

Kept whole: the schema is the one place a key is declared, with its default, range and
meaning; split by node, the YAML's order and the ConfigStore registration would be
spread over files a user greps through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.algorithms.advantages import ADVANTAGE_ESTIMATORS
from skyrl_train.algorithms.off_policy import SEQUENCE_MASK_METRICS, TIS_RATIO_TYPES
from skyrl_train.algorithms.policy_loss import POLICY_LOSS_TYPES
from skyrl_train.config.constraints import setting

# ----------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """The model a run trains: a Hugging Face checkpoint folder (``path``), or the
    built-in tiny Qwen3-MoE model (``builtin``, its architecture, with ``seed``).

    Config group ``model`` (``configs/model/``): ``tiny`` (the default) or a preset
    naming a folder ``scripts/make_checkpoint.py`` writes. With ``path`` set the
    architecture comes from its config.json and ``builtin`` must stay at its defaults
    (``config.model_source``). Either way engine and trainer load the same folder, so
    their layouts cannot drift.
    """

    path: str | None = None
    """A checkpoint folder (config.json, *.safetensors, tokenizer files, optionally
    generation_config.json) of a supported family; None means the built-in model."""
    builtin: TinyMoEConfig = field(default_factory=TinyMoEConfig)
    """The built-in model's architecture, passed whole to ``inference.models.tiny_moe``."""
    seed: int = 0
    """Seeds the built-in model's random weights (written once per architecture and seed)."""
    cache_dir: str | None = None
    """Where the built-in model's folder is written; None: ``$SKYRL_R3_CACHE``, else
    ``$XDG_CACHE_HOME/skyrl_r3``, else ``~/.cache/skyrl_r3``."""


# ------------------------------------------------------------------------- generator


@dataclass
class SamplingParamsConfig:
    """Per-request sampling; the value rules are the inference engine's own
    (``inference.engine.base.check_*``, applied by ``engine_rules.check_sampling_params``)."""

    temperature: float = 1.0
    """0.0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 means no top-k cut."""


def trainer_temperature(cfg: Any) -> float:
    """``trainer.algorithm.temperature``, or the rollout's when null (``PPOConfig``)."""
    explicit = cfg.trainer.algorithm.temperature
    return float(cfg.generator.sampling_params.temperature if explicit is None else explicit)


def support_request_width(sampling: SamplingParamsConfig, *, cap: int) -> int:
    """How many kept-set ids per token a training rollout asks the engine for: none
    without a cut, ``top_k`` with one (top-p only narrows it), else ``cap``: top-p alone
    can keep any number of tokens, and validation refuses it when the vocabulary is
    wider than ``cap`` (``generator.max_sample_support_k``)."""
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:
        return 0
    return sampling.top_k if sampling.top_k > 0 else cap


@dataclass
class EnvironmentConfig:
    env_class: str = "repeat_letter"
    """A name registered in ``skyrl_gym`` (``skyrl_gym.registered()``, entry points of
    the ``skyrl_gym.envs`` group included): the environment of dataset rows that name
    none, and the generated dataset's environment when ``data.train_data`` is empty."""
    skyrl_gym: dict[str, Any] = field(default_factory=dict)
    """Per-environment settings, SkyRL's ``environment.skyrl_gym.<env_class>`` nodes:
    each environment is built as ``make(env_class, env_config=<its node>,
    extras=<the row's fields>)`` (``docs/environments.md``)."""


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
"""The file kinds ``data.train_data`` and ``data.val_data`` take (``dataset.prompts``
reads them)."""


@dataclass
class DataConfig:
    train_data: list[str] = field(default_factory=list)
    """Parquet or JSON Lines files of prompt rows (SkyRL's schema: ``prompt``,
    ``env_class``, ``reward_spec``, optional ``data_source`` and ``extra_info``); empty:
    prompts are generated by ``environment.env_class``'s sampler."""
    val_data: list[str] = field(default_factory=list)
    """Rows for greedy evaluation, all of them each time; empty: ``trainer.eval_batch_size``
    generated prompts from a seed training never draws from."""


ENGINE_BACKENDS = ("builtin", "vllm")
"""``generator.inference_engine.backend``'s choices (``trainer.engine_clients`` makes a
client for each)."""


@dataclass
class VLLMConfig:
    """How each ``backend=vllm`` engine starts its stock vLLM server
    (``inference.vllm.spec.VLLMServerSpec``)."""

    python: str | None = None
    """vLLM's interpreter; null: the venv ``scripts/install_vllm.sh`` creates under the
    cache dir (``inference.vllm.spec.default_vllm_python``). vLLM pins its own torch and
    transformers, so it runs from its own environment and the trainer speaks HTTP to it."""
    engine_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """More vLLM server flags (SkyRL's key): ``{max_num_seqs: 64}`` -> ``--max-num-seqs
    64``; true/false -> ``--flag``/``--no-flag``. The flags the launcher sets itself
    (model, port, API key, logprobs mode, weight transport...) are refused."""
    kv_cache_memory_bytes: int | None = setting(64 << 20, ge=1)
    """vLLM's KV cache in bytes. 64 MiB holds ~44k tokens of the tiny test model (1.5 KB
    a token) and is what the tests run with; vLLM's own default takes GBs of RAM on CPU.
    null leaves vLLM's default (on GPU: a share of free memory)."""
    startup_timeout_s: float = setting(300.0, gt=0.0)
    """Deadline for ``/health``; a server is up in 33-58 s on 2 CPU cores."""
    weight_url_host: str | None = None
    """How pushed weights reach the servers. null: a safetensors file per bucket on this
    host (``/dev/shm``), so every server must run here. An address: the pushing trainer
    binds it and serves each bucket over HTTP with a token of its own, once to each
    worker of a server (each announces itself first), and the servers pull it, for
    vLLM on other hosts (``remote_urls``); ``auto``: that trainer's node address as Ray
    reports it (``inference.vllm.senders.URLBucketSender``)."""


@dataclass
class InferenceEngineConfig:
    backend: str = setting("builtin", choices=ENGINE_BACKENDS)
    """``builtin``: this project's transformers-based server (``inference.server``);
    ``vllm``: a stock vLLM server per engine (``vllm`` below; SkyRL's key)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    remote_urls: list[str] = field(default_factory=list)
    """Servers the user started (SkyRL's key), e.g. vLLM on GPU nodes: generation and
    weight sync go to them over the ``backend``'s API, and no engine is started
    (``num_engines``, ``host``, ``port`` and the ``vllm`` launch keys are then unused). A
    vLLM server takes weights through the ``skyrl_file`` transport: as files on the
    trainer's host, or pulled over HTTP with ``vllm.weight_url_host`` set."""
    remote_api_key_env: str | None = None
    """The environment variable holding ``remote_urls``' API key (never the key itself:
    a config is logged and saved with the run); null: the servers take no key."""
    num_engines: int = setting(1, ge=1)
    enable_return_routed_experts: bool = True
    """R3: the server records and returns every token's top-k experts."""
    dtype: str = setting("bfloat16", choices=("bfloat16", "float16", "float32"))
    model_name: str = "tiny-moe"
    host: str = "127.0.0.1"
    port: int = setting(0, ge=0, le=65535)
    """0 lets the OS pick a free port (each engine gets its own)."""
    batch_window_ms: float = setting(5.0, ge=0.0)
    """How long the server waits to gather requests into one forward batch."""
    max_batch_size: int = setting(64, ge=1)
    batch_invariant: bool = True
    """Generation independent of which requests share a batch (same prompt and seed,
    same tokens, logprobs and routes); the batching window otherwise makes identical
    runs diverge. Off runs the stock forward, faster at batch 64."""
    num_cpus_per_engine: float = setting(1.0, gt=0.0)
    """Ray CPU reservation of one server actor."""
    verify_weights_interval: int = setting(10, ge=0)
    """Check that every engine serves the trainer's weights after the launch's push and
    after every N-th step's (``trainer.served_weights``); 0 never checks. Four greedy
    probe requests per engine and one trainer forward."""
    verify_weights_tolerance: float = setting(0.1, gt=0.0)
    """The bound, in nats, on every probe's median |served - trainer| logprob when the
    engine's routes are replayed, else on the median over all probes' tokens
    (``trainer.served_weights``). Measured over four families and the built-in model
    (scripts/bench_served_weights.py): bf16 engines against the fp32 trainer at most
    0.032 replayed, 0.055 unreplayed (vLLM); wrong weights 0.56 and more, vLLM's MoE
    reload bug 0.36 and more (docs/vllm.md)."""


@dataclass
class GeneratorConfig:
    n_samples_per_prompt: int = setting(8, ge=1)
    """GRPO group size: trajectories per prompt."""
    max_turns: int = setting(3, ge=1)
    max_tokens_per_turn: int = setting(1, ge=1)
    max_response_tokens: int = setting(256, ge=1)
    """Token budget of one trajectory's response: every turn's generated tokens plus the
    observation tokens between them (the prompt not included); a trajectory that
    reaches it stops with "length"."""
    max_concurrent_trajectories: int = setting(32, ge=1)
    max_sample_support_k: int = setting(512, ge=1)
    """The widest kept set a training rollout's sampler may have per token: with top-k
    or top-p, each position's set travels to the trainer (sampler replay), and a cut
    that can keep more tokens than this (top_k above it, or top-p alone over a larger
    vocabulary) is refused at launch. 512 covers the built-in model's vocabulary."""
    sampling_params: SamplingParamsConfig = field(default_factory=SamplingParamsConfig)
    eval_sampling_params: SamplingParamsConfig = field(
        default_factory=lambda: SamplingParamsConfig(temperature=0.0)
    )
    eval_n_samples_per_prompt: int = setting(1, ge=1)
    """Samples per evaluation row (SkyRL's key), drawn with ``eval_sampling_params``:
    the in-run evaluation's reward means cover them all, and the evaluation command
    (``entrypoints.evaluate``) reports pass@k from them. Greedy sampling gives n equal
    samples, so n > 1 wants a temperature above 0."""
    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)


# --------------------------------------------------------------------------- trainer


REPLAY_SOURCES = ("rollout", "old_policy")
"""``trainer.policy.routing_replay.source``'s choices."""


@dataclass
class RoutingReplayConfig:
    """Which expert selection the trainer's routers use, whichever backend trains
    (``trainer.strategy``): replay a recorded one (R3 or R2), or route natively."""

    enabled: bool = True
    """Replay a recorded expert selection in the trainer's routers (see ``source``)."""
    source: str = setting("rollout", choices=REPLAY_SOURCES)
    """Where the replayed routes come from. ``rollout`` (R3): the inference engine's,
    returned with each reply, so training routes every token as generation did.
    ``old_policy`` (R2): the trainer's own, recorded in the step's old-logprob forward
    and replayed in every mini-batch and epoch update, so the PPO ratio compares
    policies under one routing; it needs no routes from the engine."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = setting(1, ge=1)
    pipeline_model_parallel_size: int = setting(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = setting(None, ge=1)
    """Interleaved pipeline chunks per rank (at least 2; the pipeline and virtual sizes
    together must divide the layer count). Replay is keyed by (chunk, microbatch), so
    every size is replayed right (docs/parallel-layouts.md)."""
    expert_model_parallel_size: int = setting(1, ge=1)
    expert_tensor_parallel_size: int | None = setting(None, ge=1)
    """None means equal to ``tensor_model_parallel_size`` (Megatron's default)."""
    context_parallel_size: int = setting(1, ge=1)
    make_vocab_size_divisible_by: int = setting(1, ge=1)
    """The embedding and output layer get ``ceil(V / (m * TP)) * m * TP`` rows for a
    vocabulary of V (Megatron's rule, m this key), so every tensor-parallel rank holds
    an equal shard; the padded ids are never scored, sampled or exported. 1 pads only
    a vocabulary TP does not divide. Megatron's own default, 128, aligns the rows for
    GPU GEMMs; here it would change every rank file's shape (and the resharding
    between TP sizes) for a vocabulary that needs no padding."""
    moe_enable_routing_replay: bool | None = None
    """Deprecated alias of ``trainer.policy.routing_replay.enabled``; null: not set. Set,
    it is copied there at composition with a warning (``config.routing_replay``). A
    worker built in Python with it null replays, the old default."""
    routing_replay_source: str | None = setting(None, choices=REPLAY_SOURCES)
    """Deprecated alias of ``trainer.policy.routing_replay.source``; null: not set."""
    transformer_config_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed through to megatron-core's ``TransformerConfig``; keys must be its fields."""


STRATEGIES = ("megatron", "fsdp")
"""``trainer.strategy``: the trainer backend (SkyRL's key and values)."""


@dataclass
class FSDPConfig:
    """The FSDP backend's node (``trainer.strategy=fsdp``): PyTorch FSDP2's
    ``fully_shard`` over transformers' own model classes, one shard group of all the
    trainer ranks (data parallel only)."""

    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward and gather them again for
    the backward (FSDP2's default: less memory, one more all-gather per layer)."""
    param_dtype: str = setting("float32", choices=("float32", "bfloat16"))
    """The dtype layers compute in; the master weights and AdamW stay fp32. fp32 by
    default: bf16 matmuls on CPU are slower than fp32 ones, and replay's
    log-prob checks want fp32."""
    reduce_dtype: str = setting("float32", choices=("float32", "bfloat16"))
    """The dtype gradients are reduced in across ranks."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping
    them (less memory, about one more forward of compute)."""
    attn_implementation: str = setting("eager", choices=("eager", "sdpa"))
    """transformers' attention kernel. ``eager`` (softmax of the full score matrix)
    computes attention as the Megatron backend does here, so the two backends' fp32
    log-probs agree within 1e-5 (``sdpa``'s fused kernel: 1.05e-5 apart on 96-token
    rows, eager 4.3e-6, scripts/bench_fsdp_vs_megatron.py). ``sdpa`` keeps no S x S
    score matrix: the memory-saving choice for long rows on GPUs (untested there)."""


@dataclass
class OptimizerConfig:
    lr: float = setting(1.5e-3, gt=0.0)
    adam_betas: list[float] = setting(
        default_factory=lambda: [0.9, 0.999], ge=0.0, lt=1.0, length=2
    )
    weight_decay: float = setting(0.0, ge=0.0)
    max_grad_norm: float = setting(1.0, gt=0.0)
    num_warmup_steps: int = setting(0, ge=0)
    """Optimizer steps (every mini-batch and epoch is one) over which the learning rate
    rises linearly to ``lr``; 0 keeps it constant. Resumes with the optimizer state."""
    num_stable_steps: int = setting(800, ge=0)
    """Optimizer steps at ``lr`` between the warm-up and the decay."""
    lr_decay_steps: int | None = setting(None, ge=0)
    """Optimizer steps after the warm-up and the stable steps over which the rate falls
    linearly from ``lr`` to ``min_lr`` (and stays there); 0 keeps it at ``lr``; null:
    over the rest of the run, however long it is, as a launch works it out
    (``config/lr_schedule.py``; a worker built outside a launch keeps ``lr``)."""
    min_lr: float = setting(0.0, ge=0.0)
    """Where ``lr_decay_steps`` ends; at most ``lr``."""


@dataclass
class PolicyConfig:
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    routing_replay: RoutingReplayConfig = field(default_factory=RoutingReplayConfig)
    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    """The reference policy: the run's initial weights (``model.path`` or the built-in
    model, never a resumed checkpoint's), kept as one copy of this rank's parameters
    beside the policy's and swapped in for a logprob forward, so it shares the policy's
    parallel layout and replays the same routes."""

    log_kl: bool = True
    """Log ``policy/kl_to_ref`` (k3 KL of the policy to the reference over the policy's
    tokens) every step. Costs the weight copy and one more forward per step;
    ``trainer.algorithm.use_kl_loss`` keeps the reference either way."""


@dataclass
class OffPolicyCorrectionConfig:
    """Corrections for the rollout having been sampled by another policy than the
    trainer's old one (the engine's numerics, or an older version with fully-async
    training); SkyRL's keys and defaults (``algorithms.off_policy``). Each uses the
    per-token ratio exp(old_logprobs - rollout_logprobs) over loss-active tokens, a
    token whose rollout logprob is the engine's -9999 placeholder counting as ratio 1.
    All null (the default): no correction.

    The sequence and outlier bounds must hold ratio 1 (low <= 1 <= high): an
    on-policy sequence is never masked. A placeholder never masks anything under any
    band (``algorithms.off_policy``)."""

    tis_ratio_type: str | None = setting(None, choices=TIS_RATIO_TYPES)
    """Truncated importance sampling: "token" weighs each token's loss by
    min(ratio, token_tis_ratio_clip_high); "sequence" weighs every token of a sequence
    by min(product of its ratios, sequence_tis_ratio_clip_high). null: no weight, unless
    ``trainer.algorithm.use_tis`` (the older spelling of "token")."""
    token_tis_ratio_clip_high: float = setting(2.0, gt=0.0)
    """With tis_ratio_type "token" (SkyRL suggests 1.5-5). With ``use_tis`` the clip is
    ``tis_imp_ratio_cap``, and setting both to different values is refused."""
    sequence_tis_ratio_clip_high: float = setting(5.0, gt=0.0)
    """With tis_ratio_type "sequence" (SkyRL suggests 2-10): a product of many ratios
    strays further from 1 than one ratio does."""
    sequence_mask_metric: str | None = setting(None, choices=SEQUENCE_MASK_METRICS)
    """Drop (weight 0) a whole sequence whose "product" of ratios is outside
    [product_mask_low, product_mask_high], or whose "geometric" mean ratio is outside
    [geo_mask_low, geo_mask_high]; null: no sequence mask."""
    product_mask_low: float = setting(0.5, ge=0.0, le=1.0)
    product_mask_high: float = setting(2.0, ge=1.0)
    geo_mask_low: float = setting(0.99, ge=0.0, le=1.0)
    """The geometric mean does not grow with length, so its window is narrow (SkyRL:
    0.99-1.01; MoE models may need it wider)."""
    geo_mask_high: float = setting(1.01, ge=1.0)
    outlier_token_is_threshold_low: float | None = setting(None, ge=0.0, le=1.0)
    """Drop a whole sequence with any token whose ratio is below this (IcePop-style);
    null: no lower bound. SkyRL's example: 1e-4."""
    outlier_token_is_threshold_high: float | None = setting(None, ge=1.0)
    """Drop a whole sequence with any token whose ratio is above this; null: no upper
    bound. SkyRL's example: 100."""
    token_mask_is_threshold_low: float | None = setting(None, gt=0.0)
    """Drop (weight 0) each token whose own ratio is below this, keeping the rest of
    its sequence (IcePop-style; SkyRL's key). On only with token_mask_is_threshold_high
    (both null: off; one alone is refused, where SkyRL ignores it); must be below it."""
    token_mask_is_threshold_high: float | None = setting(None, gt=0.0)
    """Drop each token whose ratio is above this. The band need not hold 1 (SkyRL's
    rule); a placeholder token is never dropped, whatever the band."""


@dataclass
class DynamicSamplingConfig:
    """Zero-variance groups (every sample of a prompt scored the same) carry no GRPO
    gradient; these options trade extra generation for fewer of them (DAPO, POLARIS)."""

    type: str | None = setting(None, choices=("filter", "filter_flat_steps", "replace"))
    """None: train on what was sampled. "filter" (DAPO): drop flat groups and sample
    more prompts until ``trainer.train_batch_size`` groups vary, at most
    ``max_sample_batches`` batches a step (short: flat groups fill the rest).
    "filter_flat_steps": "filter" only on a step whose groups are all flat while some
    prompts pay more than others (the step ``skip_flat_steps`` leaves out); other steps
    train on what was sampled and cost no extra round.
    "replace" (POLARIS): copy groups that vary over the flat ones, when at least
    ``min_replace_ratio`` of the groups vary."""
    max_sample_batches: int = setting(4, ge=1)
    """"filter": generation rounds per step, the first included."""
    min_replace_ratio: float = setting(0.3, ge=0.0, le=1.0)
    """"replace": the share of varying groups below which the batch is left as is."""


@dataclass
class AlgorithmConfig:
    temperature: float | None = setting(None, gt=0.0)
    """The temperature every trainer forward divides the logits by (old, new and
    reference logprobs, entropy, mismatch metrics); null: the rollout's,
    ``generator.sampling_params.temperature``, so tokens are scored under the
    distribution they were sampled from. Another value is refused unless an off-policy
    correction weighs the difference (``off_policy_correction.tis_ratio_type``)."""
    advantage_estimator: str = setting("turn_grpo", choices=ADVANTAGE_ESTIMATORS)
    """"grpo": group-normalised; "rloo": leave-one-out group baseline; "reinforce++":
    returns whitened over the batch's tokens; "turn_grpo": per-turn GRPO, a turn flat
    in its group scored against that turn over the batch (``algorithms.advantages``)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO's centred rewards by the group std (grpo and turn_grpo)."""
    advantage_eps: float = setting(1e-6, ge=0.0)
    policy_loss_type: str = setting("regular", choices=POLICY_LOSS_TYPES)
    """"regular": token-level PPO-clip; "gspo": one ratio per sequence (GSPO). GSPO's
    ratios stay near 1, so set eps_clip_low/high far tighter (the paper: 3e-4/4e-4)."""
    eps_clip_low: float = setting(0.2, ge=0.0, lt=1.0)
    eps_clip_high: float = setting(0.2, ge=0.0, lt=1.0)
    clip_ratio_c: float | None = setting(None, gt=1.0)
    """Dual-clip bound for negative advantages (> 1); None turns dual clip off.
    Regular loss only."""
    use_tis: bool = False
    """Token-level truncated importance sampling against the rollout logprobs, capped at
    ``tis_imp_ratio_cap``: the older spelling of ``off_policy_correction.tis_ratio_type:
    token`` (SkyRL deprecates it); refused together with a ``tis_ratio_type`` or a
    ``token_tis_ratio_clip_high`` that disagrees with it."""
    tis_imp_ratio_cap: float = setting(2.0, gt=0.0)
    use_kl_loss: bool = False
    """Adds ``kl_loss_coef`` x the k3 KL of the policy to the reference (``trainer.ref``)."""
    kl_loss_coef: float = setting(0.001, ge=0.0)
    use_entropy_loss: bool = True
    """Subtracts ``entropy_loss_coef`` x the token-mean entropy of the policy from the
    loss: a bonus that slows the collapse onto one answer."""
    entropy_loss_coef: float = setting(0.1, ge=0.0)
    entropy_loss_coef_end: float | None = setting(None, ge=0.0)
    """Set: the coefficient moves linearly from ``entropy_loss_coef`` at step 1 to this
    at the run's last step (``trainer.num_steps``), before ``entropy_target`` and
    ``entropy_ceiling`` scale it; null: constant. Needs ``use_entropy_loss``."""
    entropy_target: float | None = setting(None, gt=0.0)
    """Nats per token. Set: a step whose policy entropy (the old-logprob forward's, over
    the policy's own tokens) is below this trains with the bonus coefficient raised to
    ``entropy_loss_coef * entropy_target / entropy`` (at most ``ENTROPY_BOOST_CAP``
    times the coefficient), so groups keep varying instead of settling on one answer a
    prompt; at or above it the coefficient is ``entropy_loss_coef``. Null: constant.
    Refused without a bonus to scale (``use_entropy_loss`` false or a coefficient of 0)."""
    entropy_ceiling: float | None = setting(None, gt=0.0)
    """Nats per token. Set: a step whose policy entropy (the same measure as
    ``entropy_target``'s) is at or above this trains with no entropy bonus, so the bonus
    keeps a policy from settling on one answer without pushing a near-uniform one further
    towards uniform. Null: the bonus applies at every entropy. Refused without a bonus,
    and at or below ``entropy_target``."""
    skip_flat_steps: bool | None = None
    """A step whose groups are all flat (every sample of each prompt scored the same)
    while some prompts pay more than others makes no optimizer step: its policy
    gradient is zero, so the entropy bonus and the KL term would be all that is left,
    and the bonus alone pulls a policy that has learned something back towards uniform
    (the late collapse in docs/experiments.md). A step with any varying group, or one
    where every sample scored the same (nothing found yet: the bonus explores), trains
    as before; metrics are logged either way. Null: the estimator decides, on under
    grpo and rloo, off under turn_grpo and reinforce++ (they have no such step: a flat
    group still has a signal there); true under those two is refused."""
    zero_variance_filter: bool = False
    """Leave flat groups (every sample scored the same) out of the loss: their tokens
    add nothing to the policy gradient, so without the filter they carry only the
    entropy bonus; a mini-batch whose groups are all flat makes no optimizer step.
    Metrics still cover every group. GRPO and RLOO only (SkyRL's key): true under
    turn_grpo or reinforce++, whose flat groups still have advantages, is refused."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    off_policy_correction: OffPolicyCorrectionConfig = field(
        default_factory=OffPolicyCorrectionConfig
    )


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray's placement-group strategies (``ray.util.placement_group``)."""


@dataclass
class PlacementConfig:
    num_trainers: int = setting(1, ge=1)
    """Policy trainer processes (Megatron world size)."""
    cpus_per_trainer: float = setting(1.0, gt=0.0)
    strategy: str | None = setting(None, choices=PLACEMENT_STRATEGIES)
    """null: Ray places each rank alone, by its CPUs. A Ray placement-group strategy:
    the ranks are reserved together in one placement group, a bundle of
    ``cpus_per_trainer`` CPUs per rank (the ranks of a node consecutive, the driver's
    node first: ``policy_group.rank_bundles``); ``STRICT_SPREAD`` puts
    every rank on a node of its own (refused with more than one rank on a local Ray,
    which has one node), ``STRICT_PACK`` all on one node
    (docs/cluster-and-security.md)."""
    timeout_s: float = setting(600.0, gt=0.0)
    """How long a launch waits for Ray to place ``strategy``'s placement group (a
    cluster may be adding nodes) before it refuses, naming the strategy and the nodes
    Ray has: Ray queues a group it cannot place forever, without a message."""


@dataclass
class WeightSyncConfig:
    mode: str = setting("full", choices=("full", "delta"))
    """"full" sends every tensor each step; "delta" only tensors that changed."""
    max_threads: int = setting(2, ge=1)
    """Cap for the sync thread pool (sized by ``cpu_topology.pool_workers``)."""


@dataclass
class FullyAsyncConfig:
    """Overlap generation with training (SkyRL's keys). Generation for the next steps
    runs while a step trains, and weights are pushed between steps; each trajectory
    carries the policy version the servers generated it with."""

    enabled: bool = False
    max_staleness_steps: int = setting(1, ge=1)
    """How many versions older than the one that trains on it a trajectory's oldest
    turn may be: step k trains version k-1 on turns of version >= k-1-this. Generation
    for step k waits for version k-1-this, so the bound holds by construction."""


@dataclass
class TrainerConfig:
    strategy: str = setting("megatron", choices=STRATEGIES)
    """The trainer backend: ``megatron`` (megatron-core, every parallel layout in
    docs/parallel-layouts.md) or ``fsdp`` (FSDP2 over transformers' model classes,
    data parallel only). Each has its own node under ``trainer.policy``
    (``megatron_config``, ``fsdp_config``); a key of the other backend's is refused."""
    seed: int = 0
    num_steps: int = setting(150, ge=1)
    train_batch_size: int = setting(8, ge=1)
    """Prompts per training step (trajectories = this x n_samples_per_prompt)."""
    policy_mini_batch_size: int = setting(1, ge=1)
    """Prompts per optimizer step."""
    micro_train_batch_size_per_gpu: int = setting(32, ge=1)
    """Trajectories per forward/backward on one trainer rank, at most: a per-rank
    mini-batch no larger than this is one microbatch; a larger one must divide by it."""
    micro_forward_batch_size_per_gpu: int = setting(64, ge=1)
    """Trajectories per logprob-only forward on one trainer rank."""
    max_tokens_per_microbatch: int = setting(-1, ge=1, also=(-1,))
    """Real (unpadded) tokens per microbatch on one trainer rank, training and
    logprob forwards alike (SkyRL's key): -1 off, microbatches counted in rows by the
    two keys above; N > 0, rows bin-packed under N tokens each, a longer row alone in
    its own, rows never split, the two row counts above then unused. Every rank runs the
    same number of microbatches (the largest any rank's budget needs, agreed with one
    all-reduce; ``workers/microbatches.py``), and the loss stays the mini-batch's token
    mean (``algorithms/token_mean.py``)."""
    remove_microbatch_padding: bool = True
    """Pack each microbatch's rows into one row without padding (SkyRL's key since
    0.4.0; docs/r3-and-pipeline.md, "Packed batches"): false keeps the padded
    ``[rows, longest row]`` layout, which trains the same numbers (to 1e-5) and is
    faster on short rows of equal length."""
    use_sample_packing: bool | None = None
    """Deprecated alias of ``remove_microbatch_padding`` (SkyRL's name before 0.4.0);
    null: not set. Set, it is copied there at composition with a warning
    (``config.sample_packing``); the two set differently are refused."""
    update_epochs_per_batch: int = setting(1, ge=1)
    eval_interval: int = setting(10, ge=0)
    """Steps between evaluations; 0 turns evaluation off."""
    eval_batch_size: int = setting(30, ge=1)
    """Generated prompts per evaluation when ``data.val_data`` is empty (each sampled
    ``generator.eval_n_samples_per_prompt`` times, greedy by default)."""
    ckpt_interval: int = setting(0, ge=0)
    """Steps between checkpoints; 0 turns checkpointing off."""
    max_ckpts_to_keep: int | None = setting(-1, ge=1, also=(-1,))
    """Complete checkpoints kept under ``<run_dir>/checkpoints``: after each save the
    oldest beyond this many are deleted (never the one just written). -1 or None keeps
    all (SkyRL's key and default)."""
    hf_save_interval: int = setting(0, ge=-1)
    """Steps between Hugging Face exports, ``<export_path>/global_step_N`` folders that
    transformers, vLLM and ``model.path`` load (``skyrl_train.runs.export``): 0 at the
    last step only, -1 never, N every N steps and at the last (SkyRL's key)."""
    export_path: str | None = None
    """Where the exports go; null: ``<run_dir>/exports``."""
    resume_from: str | None = None
    """A ``step_NNNNNN`` checkpoint folder, or ``latest``: the newest checkpoint under
    ``<run_dir>/checkpoints`` whose files verify (damaged ones are skipped, each named
    in a warning; with none, the folder's run goes on from where it began: a run
    killed before its first save starts again from step 0, a branch resumes its branch
    point, a folder no run wrote to starts fresh, so one command serves a job's first
    launch and its resubmissions; a folder named latest is ``./latest``). Verified against its manifest, and
    ``latest`` resolved, once at launch before Ray starts. Resumed into the run_dir it
    came from, the run first drops the metrics lines of the steps after the
    checkpoint's (each step is logged once); into another run_dir, that folder must be
    fresh (``skyrl_train.runs.folder`` has the rules). One key, where SkyRL has
    ``resume_mode`` and ``resume_path``: a pair can contradict itself (mode ``none``
    with a path, ``latest`` with a path elsewhere), and a launch would have to guess
    which one the user meant."""
    overwrite_later_checkpoints: bool = False
    """Allow resuming from a checkpoint of ``<run_dir>/checkpoints`` below others in
    it: each save of the resumed run replaces the old checkpoint of its step, and its
    pruning deletes the higher ones first. A separate key, not implied by
    ``resume_from``, because a path to an earlier step is also what a typo or a stale
    command looks like and the deletion cannot be undone (and the old higher steps,
    if kept, would be what ``latest`` resumes next): without it such a launch is
    refused before Ray starts, naming the checkpoints it would lose."""
    run_dir: str = "runs/r3_grpo"
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)


# -------------------------------------------------------------------- ray and logging


@dataclass
class RayConfig:
    address: str | None = None
    """None starts a local Ray; otherwise the address of a running cluster."""
    num_cpus: int | None = setting(None, ge=1)
    """CPUs a local Ray may use; None lets Ray count them."""
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoggingConfig:
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where each step's metrics go, any of (``skyrl_train.utils.tracking.TRACKERS``):
    ``jsonl`` (one line per step in ``<run_dir>/metrics.jsonl``, which ``plot`` reads),
    ``tensorboard`` (``<run_dir>/tensorboard``), ``wandb`` and ``mlflow`` (a run named
    after ``run_dir``; project, mode and server from their own environment variables).
    The last three are extras (``pip install 'skyrl-r3[tensorboard]'``); one that is
    not installed, an unknown name or a repeated one fails validation."""
    progress_bar: bool = True
    plot: bool = True
    """Save ``<run_dir>/metrics.png`` at the end of the run."""
    dump_rollouts: int = setting(8, ge=0)
    """Trajectories of each training step and each evaluation written to
    ``<run_dir>/rollouts/`` (whole GRPO groups, the first ones), with their tokens,
    rewards, advantages, both logprobs and where the routers disagreed; 0 writes none.
    ``python -m skyrl_train.entrypoints.view RUN_DIR`` shows them
    (``skyrl_train/runs/rollouts.py``)."""


@dataclass
class PPOConfig:
    """The whole pipeline: ``configs/ppo_base_config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
