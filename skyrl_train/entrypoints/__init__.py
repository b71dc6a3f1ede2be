"""Command lines: ``main_base`` (a GRPO run with R3 on Ray, Hydra config)."""
