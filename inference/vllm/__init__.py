"""vLLM as the rollout engine, from the server process to the trainer's client.

Server side: ``spec`` (what to start and with which flags), ``process`` (a stock vLLM
OpenAI server process and its whole process group), ``actor`` (the same as a Ray
actor), ``worker_extension`` (loaded into vLLM's workers: the CPU weight transport and
the MoE reload guard) with ``seeded_sampling`` (seeded requests that survive a split
prompt). ``transport`` is the contract both sides import. Client side:
``client`` (token-in/token-out generation), ``replies`` (a vLLM reply as a
``GenerateResult``), ``push`` and ``senders`` (a weight push over vLLM's RL API).

vLLM runs from its own Python environment (``scripts/install_vllm.sh``): it pins its own
torch and transformers, and the trainer only speaks HTTP to it.
"""
