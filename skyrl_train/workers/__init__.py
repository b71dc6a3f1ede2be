"""The trainer ranks' model code, two backends behind one contract.

``base`` is the ``PolicyWorker`` contract the trainer holds (its gradient and route
contracts, ``RankInfo`` and the result types); ``factory`` builds the
``trainer.strategy`` backend's worker inside the rank actor; ``megatron`` (megatron-core)
and ``fsdp`` (transformers' own model classes under FSDP2) are the backends. What both
share: ``batch_layout`` (the contiguous re-layout and response scoring), ``routes`` (route
checks before any replay) and ``step`` (one optimizer step's body). The driver loads
``base`` alone, never a backend package."""
