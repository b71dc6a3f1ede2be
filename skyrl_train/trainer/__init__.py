"""The GRPO + R3 training loop: policy actor, weight sync, checkpoints, orchestration."""
