"""Model descriptions shared by the engine and the trainer: ``architecture`` (one
family-independent MoE description), ``families`` (the four Hugging Face families),
``checkpoint`` (a checkpoint folder, checked), ``tiny_moe`` and ``tiny_checkpoint``
(the built-in model and small random checkpoints), ``tokenizer``, and
``batch_invariant`` (the batch-invariant CPU forward).
"""
