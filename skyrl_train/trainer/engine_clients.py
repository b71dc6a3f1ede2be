"""The one place a client for an inference server's URL is made, given the run's
``generator.inference_engine.backend``: the generator's clients (``trainer.loop``) and
the weight syncer's (``trainer.policy``) both come from ``make_client``.

``builtin`` servers know their checkpoint (EOS ids, route shape) and report it;
a stock vLLM server started with ``--skip-tokenizer-init`` knows neither, so its
client is told both (``ClientOptions.for_run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from skyrl_train.config.schema import ENGINE_BACKENDS as BACKENDS

if TYPE_CHECKING:
    from inference.client import GenerateClient, RouteShape
    from inference.models.checkpoint import CheckpointInfo
    from skyrl_train.config.schema import PPOConfig


@dataclass(frozen=True)
class ClientOptions:
    """What a client needs beyond its URL; picklable, so trainer actors take it."""

    backend: str = "builtin"
    api_key: str | None = field(default=None, repr=False)
    eos_token_ids: tuple[int, ...] = ()
    """vLLM only: added to every request's stop ids unless it sets ``ignore_eos`` (the
    builtin engine adds its checkpoint's itself); empty for a weight-sync-only client."""
    route_shape: RouteShape | None = None
    """vLLM only: the shape routes are decoded to (vLLM does not report it); None for a
    client that never requests routes."""
    family: str | None = None
    """vLLM only: the checkpoint's family, for the names vLLM loads pushed weights under
    (``inference.vllm.layouts``)."""
    weight_url_host: str | None = None
    """vLLM only: ``generator.inference_engine.vllm.weight_url_host`` (None: bucket files
    on this host)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"generator.inference_engine.backend: expected one of {list(BACKENDS)}, "
                f"got {self.backend!r}"
            )

    @classmethod
    def for_run(cls, cfg: PPOConfig, info: CheckpointInfo, *, api_key: str | None) -> ClientOptions:
        """Generation clients of a run on checkpoint ``info``."""
        from inference.client import RouteShape

        arch = info.architecture
        return cls(
            backend=cfg.generator.inference_engine.backend,
            api_key=api_key,
            eos_token_ids=tuple(info.eos_token_ids),
            family=arch.family,
            route_shape=RouteShape(
                num_layers=arch.num_moe_layers,
                top_k=arch.num_experts_per_tok,
                num_experts=arch.num_experts,
            ),
        )


def make_client(url: str, options: ClientOptions) -> GenerateClient:
    """A client of the server at ``url``; close it (``await client.close()``) after use."""
    if options.backend == "vllm":
        # Imported only for vLLM runs: the builtin path never loads the vLLM modules.
        from inference.vllm.client import VLLMClient
        from inference.vllm.senders import URLBucketSender

        host = options.weight_url_host
        if host == "auto":
            import ray

            host = ray.util.get_node_ip_address()
        return VLLMClient(
            url,
            api_key=options.api_key,
            eos_token_ids=options.eos_token_ids,
            route_shape=options.route_shape,
            family=options.family,
            # Served only once a push starts: a generation-only client never binds it.
            sender=None if host is None else URLBucketSender(host),
        )
    from inference.client import RemoteGenerateClient

    return RemoteGenerateClient(url, api_key=options.api_key)
