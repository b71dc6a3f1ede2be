"""Typed records mirroring ``configs/ppo_base_config.yaml`` node for node.

Each dataclass is the schema of one YAML node: the loader (``loader.py``) refuses
keys a dataclass does not declare and values of the wrong type, naming the dotted
key. Defaults here equal the YAML's (a test pins that), so code that builds a config
in Python and a launch that reads the YAML see the same run. Semantic checks
(divisibility, R3 compatibility) live in one place: ``validate.py``.

Key names follow SkyRL where SkyRL has one, so launch scripts carry over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.models.tiny_moe import TinyMoEConfig

# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelConfig:
    """The model a run trains: a Hugging Face checkpoint folder (``path``), or the
    built-in tiny Qwen3-MoE model described by the other keys.

    The architecture keys (``TinyMoEConfig``'s fields) describe only the built-in model;
    with ``path`` set the architecture comes from its config.json and these keys must
    stay at their defaults (``config.model_source``). Either way engine and trainer
    load the same folder, so their layouts cannot drift.
    """

    vocab_size: int = 264
    hidden_size: int = 64
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.2
    seed: int = 0
    """Seeds the built-in model's random weights (written once per config and seed)."""
    path: str | None = None
    """A checkpoint folder (config.json, *.safetensors, tokenizer files, optionally
    generation_config.json) of a supported family; None means the built-in model."""
    cache_dir: str | None = None
    """Where the built-in model's folder is written; None: ``$SKYRL_R3_CACHE``, else
    ``$XDG_CACHE_HOME/skyrl_r3``, else ``~/.cache/skyrl_r3``."""

    def tiny_moe(self) -> TinyMoEConfig:
        """The architecture alone; raises ``ValueError`` if it is inconsistent."""
        names = {f.name for f in dataclasses.fields(TinyMoEConfig)}
        return TinyMoEConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


# ------------------------------------------------------------------------- generator


@dataclass(frozen=True)
class SamplingParamsConfig:
    temperature: float = 1.0
    """0.0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 means no top-k cut."""


@dataclass(frozen=True)
class EnvConfig:
    name: str = "guess_number"
    """A name registered in ``skyrl_gym`` (``skyrl_gym.registered()``)."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"max_turns": 3})
    """Passed to the environment's constructor as keyword arguments."""


@dataclass(frozen=True)
class InferenceEngineConfig:
    num_engines: int = 1
    enable_return_routed_experts: bool = True
    """R3: the server records and returns every token's top-k experts."""
    backend: Literal["hf_cpu"] = "hf_cpu"
    """The engine implementation; vLLM is not installable on CPU machines."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    model_name: str = "tiny-moe"
    host: str = "127.0.0.1"
    port: int = 0
    """0 lets the OS pick a free port (each engine gets its own)."""
    batch_window_ms: float = 5.0
    """How long the server waits to gather requests into one forward batch."""
    max_batch_size: int = 64
    batch_invariant: bool = True
    """Generation independent of which requests share a batch (same prompt and seed,
    same tokens, logprobs and routes); the batching window otherwise makes identical
    runs diverge. Off runs the stock forward, faster at batch 64."""
    num_cpus_per_engine: float = 1.0
    """Ray CPU reservation of one server actor."""


@dataclass(frozen=True)
class GeneratorConfig:
    n_samples_per_prompt: int = 8
    """GRPO group size: trajectories per prompt."""
    max_turns: int = 3
    max_tokens_per_turn: int = 4
    max_trajectory_tokens: int = 256
    """Prompt + all turns' tokens; a trajectory that reaches it stops with "length"."""
    max_concurrent_trajectories: int = 32
    sampling_params: SamplingParamsConfig = field(default_factory=SamplingParamsConfig)
    eval_sampling_params: SamplingParamsConfig = field(
        default_factory=lambda: SamplingParamsConfig(temperature=0.0)
    )
    env: EnvConfig = field(default_factory=EnvConfig)
    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)


# --------------------------------------------------------------------------- trainer


@dataclass(frozen=True)
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline chunks; refused with routing replay (replay goes stale)."""
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """None means equal to ``tensor_model_parallel_size`` (Megatron's default)."""
    context_parallel_size: int = 1
    moe_enable_routing_replay: bool = True
    """R3: replay the rollout's expert selection in the trainer's routers."""
    transformer_config_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed through to megatron-core's ``TransformerConfig``; keys must be its fields."""


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-3
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_warmup_steps: int = 0


@dataclass(frozen=True)
class PolicyConfig:
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass(frozen=True)
class RefConfig:
    """The reference model; built only when ``trainer.algorithm.use_kl_loss`` is on."""

    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage_estimator: Literal["grpo"] = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    advantage_eps: float = 1e-6
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (> 1); None turns dual clip off."""
    loss_reduction: Literal["token_mean"] = "token_mean"
    use_tis: bool = False
    """Truncated importance sampling against the rollout logprobs."""
    tis_imp_ratio_cap: float = 2.0
    use_kl_loss: bool = False
    """Builds the reference model and adds a k3 KL penalty (off: faster CPU runs)."""
    kl_loss_coef: float = 0.001


@dataclass(frozen=True)
class PlacementConfig:
    num_trainers: int = 1
    """Policy trainer processes (Megatron world size)."""
    colocate: bool = False
    """Share CPUs between trainers and inference engines instead of reserving them."""
    cpus_per_trainer: float = 1.0


@dataclass(frozen=True)
class WeightSyncConfig:
    mode: Literal["full", "delta"] = "full"
    """"full" sends every tensor each step; "delta" only tensors that changed."""
    max_threads: int = 2
    """Cap for the sync thread pool (sized by ``cpu_topology.pool_workers``)."""


@dataclass(frozen=True)
class TrainerConfig:
    seed: int = 0
    num_steps: int = 40
    train_batch_size: int = 8
    """Prompts per training step (trajectories = this x n_samples_per_prompt)."""
    policy_mini_batch_size: int = 8
    """Prompts per optimizer step."""
    micro_train_batch_size_per_gpu: int = 64
    """Trajectories per forward/backward on one trainer rank."""
    micro_forward_batch_size_per_gpu: int = 64
    """Trajectories per logprob-only forward on one trainer rank."""
    update_epochs_per_batch: int = 1
    eval_interval: int = 5
    """Steps between evaluations; 0 turns evaluation off."""
    eval_batch_size: int = 16
    """Prompts per evaluation (one greedy sample each)."""
    ckpt_interval: int = 0
    """Steps between checkpoints; 0 turns checkpointing off."""
    max_ckpts_to_keep: int | None = -1
    """Complete checkpoints kept under ``<run_dir>/checkpoints``: after each save the
    oldest beyond this many are deleted (never the one just written). -1 or None keeps
    all (SkyRL's key and default)."""
    resume_from: str | None = None
    """A ``step_NNNNNN`` checkpoint folder; verified against its manifest at launch,
    before Ray starts. Resumed into the run_dir it came from, the run first drops
    the metrics lines of the steps after the checkpoint's (each step is logged once)."""
    run_dir: str = "runs/r3_grpo"
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


# -------------------------------------------------------------------- ray and logging


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    """None starts a local Ray; otherwise the address of a running cluster."""
    num_cpus: int | None = None
    """CPUs a local Ray may use; None lets Ray count them."""
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoggingConfig:
    jsonl: bool = True
    """One JSON line of metrics per step in ``<run_dir>/metrics.jsonl``."""
    tensorboard: bool = True
    """Write event files to ``<run_dir>/tensorboard`` when ``tensorboard`` is installed;
    silently skipped otherwise, so the default install stays small."""
    progress_bar: bool = True
    plot: bool = True
    """Save ``<run_dir>/metrics.png`` at the end of the run."""


@dataclass(frozen=True)
class PPOConfig:
    """The whole pipeline: ``configs/ppo_base_config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
