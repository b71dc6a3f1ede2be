"""``python -m inference.server``: serve a CPU MoE engine over HTTP until interrupted.

    python -m inference.server --checkpoint DIR [--port 0] [--api-key-env NAME]
        [--max-sample-support-k K]

``--checkpoint`` names a Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral checkpoint folder (for a
tiny one: ``scripts/make_checkpoint.py``); it is checked before the model loads. Without
it the built-in model is randomly initialised (``--tiny-moe-json``, ``--model-seed``).
Prints ``serving <url>`` once bound (with ``--port 0`` the OS picks the port), so a
launcher can read the URL from the first line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from inference.server.app import ServerConfig
from inference.server.launch import EngineSpec
from inference.server.runner import start_server


def parse_args(argv: list[str] | None = None) -> tuple[EngineSpec, ServerConfig]:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="python -m inference.server", description=__doc__)
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument(
        "--api-key-env",
        default=None,
        help="name of an environment variable holding the bearer token (a key on the "
        "command line would show in ps)",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint folder (config.json, *.safetensors, tokenizer) of a supported family",
    )
    parser.add_argument(
        "--tiny-moe-json",
        default=None,
        help="without --checkpoint: TinyMoEConfig overrides as JSON (random init)",
    )
    parser.add_argument("--model-seed", type=int, default=0, help="random-init weights only")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--model-name", default="tiny-moe")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="outputs independent of what a request is batched with (default); "
        "--no-batch-invariant runs the faster stock forward",
    )
    parser.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument(
        "--max-sample-support-k",
        type=int,
        default=defaults.max_sample_support_k,
        help="the widest kept set a request may ask for (return_sample_support); a "
        "trainer's top-p cut asks for up to its generator.max_sample_support_k, top-k "
        "for k (reported on /health as limits.max_sample_support_k)",
    )
    parser.add_argument("--keepalive-timeout-s", type=float, default=defaults.keepalive_timeout_s)
    parser.add_argument(
        "--request-read-timeout-s", type=float, default=defaults.request_read_timeout_s
    )
    parser.add_argument(
        "--weight-read-timeout-s", type=float, default=defaults.weight_read_timeout_s
    )
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    args = parser.parse_args(argv)

    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env: expected a set, non-empty ${args.api_key_env}")
    if args.checkpoint is not None:
        if args.tiny_moe_json is not None:
            parser.error("--tiny-moe-json: expected no overrides with --checkpoint, got some")
        # Refuse a bad folder now, naming the file and field, not after the model loads.
        from inference.errors import CheckpointFormatError
        from inference.models.checkpoint import inspect_checkpoint

        try:
            inspect_checkpoint(args.checkpoint)
        except CheckpointFormatError as exc:
            parser.error(f"--checkpoint {args.checkpoint}: {exc}")
    tiny_json = "{}" if args.tiny_moe_json is None else args.tiny_moe_json
    try:
        tiny = json.loads(tiny_json)
    except json.JSONDecodeError as exc:
        parser.error(f"--tiny-moe-json: expected a JSON object, got {tiny_json!r} ({exc})")
    if not isinstance(tiny, dict):
        parser.error(f"--tiny-moe-json: expected a JSON object, got {tiny_json!r}")
    engine = EngineSpec(
        tiny_moe=tiny,
        checkpoint=args.checkpoint,
        seed=args.model_seed,
        dtype=args.dtype,
        model_name=args.model_name,
        batch_invariant=args.batch_invariant,
    )
    try:
        server = ServerConfig(
            host=args.host,
            port=args.port,
            api_key=api_key,
            max_request_bytes=args.max_request_bytes,
            max_new_tokens=args.max_new_tokens,
            max_model_len=args.max_model_len,
            max_sample_support_k=args.max_sample_support_k,
            # A cap below the default k lowers it: the default has no flag of its own.
            default_sample_support_k=min(
                defaults.default_sample_support_k, max(args.max_sample_support_k, 1)
            ),
            keepalive_timeout_s=args.keepalive_timeout_s,
            request_read_timeout_s=args.request_read_timeout_s,
            weight_read_timeout_s=args.weight_read_timeout_s,
            max_connections=args.max_connections,
        )
    except ValueError as exc:
        hint = " (pass --api-key-env)" if api_key is None and "api_key" in str(exc) else ""
        parser.error(f"{exc}{hint}")
    return engine, server


async def serve(engine_spec: EngineSpec, config: ServerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    server = await start_server(engine_spec.build(), config)
    print(f"serving {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        print("stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    engine_spec, config = parse_args(argv)
    asyncio.run(serve(engine_spec, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
