"""From generator output to a training batch, and the prompts that feed the generator.

``prompts`` (dataset files and generated prompts, checked before anything starts),
``preprocess`` (``GeneratorOutput`` -> padded ``TrainingBatch``), ``routes`` (the route
rows' collation into ``[B, S, L, K]``), ``batch`` (``TrainingBatch`` and its row
operations, shared by the driver and the workers).
"""
