"""The trainer ranks' model code; ``megatron`` is the one backend (Megatron-core with
routing replay). Imported only inside trainer actors: the driver never needs it."""
