"""The builtin inference engine behind the server: ``base`` (the seam the server asks
of any backend), ``hf_engine`` (transformers MoE with route capture), ``decode`` and
``prefill`` (one batched run), ``sampling`` (one random stream per request),
``capture`` (router hooks), ``weights`` (loading and export in the engine layout).
"""
