"""The trainer ranks' model code: ``base`` (the ``PolicyWorker`` contract the trainer
holds, with its result types), ``factory`` (builds a backend's worker inside the rank
actor) and ``megatron``, the one backend (Megatron-core with routing replay). The
driver loads ``base`` alone, never a backend package."""
