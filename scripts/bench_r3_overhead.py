"""R3 overhead: the same seeded workload with route capture + transfer on vs off.

    OMP_NUM_THREADS=1 python3 scripts/bench_r3_overhead.py [--requests 64] [--json]

Two measurements on the default tiny MoE (bf16, CPU, 1 torch thread):
  * engine: ``HFMoEEngine.generate_sync`` with capture on vs off (capture cost alone);
  * http: the real aiohttp server + ``RemoteGenerateClient`` with 64 concurrent
    requests, routes packed, sent, spliced and decoded on vs off (the full R3 path).
Capture does not change the computation, so both arms generate identical tokens
(checked); arms alternate per repeat so machine noise hits both alike. Also reports
64-concurrent vs sequential throughput through the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.engine.base import EngineRequest, SamplingParams  # noqa: E402
from inference.engine.hf_engine import HFMoEEngine  # noqa: E402


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(31 * r + 7 * i) % 256 for i in range(length)] for r in range(n)]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    engine = HFMoEEngine.from_config(seed=0)
    prompts = _prompts(args.requests, args.prompt_len)

    def run(capture: bool) -> tuple[float, list[list[int]], int]:
        reqs = [
            EngineRequest(
                p,
                SamplingParams(max_tokens=args.max_tokens, seed=i),
                return_routed_experts=capture,
            )
            for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        outs = engine.generate_sync(reqs)
        dt = time.perf_counter() - t0
        rows = sum(o.routed_experts.shape[0] for o in outs if o.routed_experts is not None)
        return dt, [o.token_ids for o in outs], rows

    run(False)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    rows = 0
    for _ in range(args.repeats):
        for capture in (False, True):
            dt, toks, r = run(capture)
            times[capture].append(dt)
            tokens[capture] = toks
            rows = max(rows, r)
    assert tokens[True] == tokens[False], "capture changed the generated tokens"
    generated = sum(len(t) for t in tokens[True])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {
        "generated_tokens": generated,
        "route_rows": rows,
        "off_s": _spread(times[False]),
        "on_s": _spread(times[True]),
        "off_tok_per_s": generated / off,
        "on_tok_per_s": generated / on,
        "overhead": on / off - 1.0,
    }


async def _http(args: argparse.Namespace) -> dict[str, Any]:
    from inference.client import GenerateRequest, RemoteGenerateClient
    from inference.server import EngineSpec, ServerConfig, ServerThread

    server = ServerThread(EngineSpec(seed=0).build, ServerConfig())
    url = await asyncio.to_thread(server.start)
    prompts = _prompts(args.requests, args.prompt_len)
    try:
        async with RemoteGenerateClient(url, max_connections=args.requests) as client:

            def requests(capture: bool) -> list[GenerateRequest]:
                return [
                    GenerateRequest(
                        p,
                        {"max_tokens": args.max_tokens, "seed": i, "temperature": 1.0},
                        return_routed_experts=capture,
                        routed_experts_prompt_start=0 if capture else None,
                    )
                    for i, p in enumerate(prompts)
                ]

            async def run(capture: bool, concurrency: int) -> tuple[float, list[Any]]:
                reqs = requests(capture)
                t0 = time.perf_counter()
                results = await client.generate_batch(reqs, max_concurrency=concurrency)
                return time.perf_counter() - t0, results

            await run(False, args.requests)  # warm-up
            times: dict[bool, list[float]] = {False: [], True: []}
            results: dict[bool, list[Any]] = {}
            for _ in range(args.repeats):
                for capture in (False, True):
                    dt, results[capture] = await run(capture, args.requests)
                    times[capture].append(dt)
            on_ids = [r.response_ids for r in results[True]]
            assert on_ids == [r.response_ids for r in results[False]], "capture changed tokens"
            for p, r in zip(prompts, results[True], strict=True):
                expected = len(p) + len(r.response_ids) - 1
                assert r.routed_experts is not None and r.routed_experts.shape[0] == expected
            generated = sum(len(i) for i in on_ids)
            off, on = statistics.median(times[False]), statistics.median(times[True])

            # Concurrency: a sequential slice of the workload vs all of it at once.
            seq_n = max(1, args.requests // 8)
            seq_reqs = requests(True)[:seq_n]
            t0 = time.perf_counter()
            seq_results = [
                await client.generate(
                    prompt_token_ids=r.prompt_token_ids,
                    sampling_params=r.sampling_params,
                    return_routed_experts=True,
                    routed_experts_prompt_start=0,
                )
                for r in seq_reqs
            ]
            seq_s = time.perf_counter() - t0
            seq_tok = sum(len(r.response_ids) for r in seq_results)
    finally:
        await asyncio.to_thread(server.stop)
    concurrent_tps = generated / on
    sequential_tps = seq_tok / seq_s
    return {
        "generated_tokens": generated,
        "off_s": _spread(times[False]),
        "on_s": _spread(times[True]),
        "off_tok_per_s": generated / off,
        "on_tok_per_s": concurrent_tps,
        "overhead": on / off - 1.0,
        "sequential_requests": seq_n,
        "sequential_tok_per_s": sequential_tps,
        "concurrency_speedup": concurrent_tps / sequential_tps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-http", action="store_true", help="engine-level figures only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    report: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "model": "TinyMoEConfig() bf16",
        },
        "engine": bench_engine(args),
    }
    if not args.skip_http:
        report["http"] = asyncio.run(_http(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"python {report['python']}  torch {report['torch']}  transformers "
        f"{report['transformers']}  threads {report['torch_threads']}"
    )
    print(f"workload: {report['workload']}")
    for name in ("engine", "http"):
        if name not in report:
            continue
        r = report[name]
        print(
            f"[{name}] off {r['off_tok_per_s']:.0f} tok/s (median {r['off_s']['median']:.3f} s, "
            f"{r['off_s']['min']:.3f}-{r['off_s']['max']:.3f})  on {r['on_tok_per_s']:.0f} tok/s "
            f"(median {r['on_s']['median']:.3f} s, {r['on_s']['min']:.3f}-{r['on_s']['max']:.3f})"
            f"  R3 overhead {100 * r['overhead']:+.1f}%  (tokens identical: yes)"
        )
    if "http" in report:
        h = report["http"]
        print(
            f"[http] {h['sequential_requests']} sequential requests: "
            f"{h['sequential_tok_per_s']:.0f} tok/s; {args.requests} concurrent: "
            f"{h['on_tok_per_s']:.0f} tok/s; speedup {h['concurrency_speedup']:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
