"""R3 overhead: the same seeded workload with route capture + transfer on vs off.

    OMP_NUM_THREADS=1 python3 scripts/bench_r3_overhead.py [--requests 64] [--repeats 7] [--json]

Measurements on the default tiny MoE (bf16, CPU, 1 torch thread), each on vs off:
  * engine: ``HFMoEEngine.generate_sync`` with capture on vs off (capture cost alone);
  * http: the real aiohttp server + ``RemoteGenerateClient`` with 64 concurrent
    requests, the body training asks for on (routes plus the fully packed body) vs
    the plain reply off: the full R3 path;
  * the split of the http overhead: capture (the engine figure), packing (rendering
    the 64 replies with vs without routes), client decode (parsing those same bodies),
    and the rest (HTTP transfer of the extra bytes, the splice, scheduling): http
    overhead minus the three. Each part is seconds per workload, shown as a share of
    the off arm's http time.
Capture does not change the computation, so both arms generate identical tokens
(checked); arms alternate per repeat so machine noise hits both alike. Also reports
64-concurrent vs sequential throughput through the server.

For the on/off arms the server's batching window is widened to 1 s with
``max_batch_size`` equal to the request count, so every repeat of either arm runs its
requests as one forward batch:
the window closes as soon as the batch is full, so nothing waits it out. With the
default 5 ms window the 64 arrivals split into one or two forward batches by chance,
and that moved the http figure between -0.2% and +20.7% run to run.
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


def bench_engine(args: argparse.Namespace, samples: dict[str, Any]) -> dict[str, Any]:
    """Capture on vs off; ``samples`` receives the last on-arm requests and outputs."""
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
        if capture:
            samples["requests"], samples["outputs"] = reqs, outs
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
        # Each repeat's on/off pair ran back to back: their ratio cancels the slower
        # drifts (another process, a frequency change) that the two medians do not.
        "overhead_paired": statistics.median(
            a / b for a, b in zip(times[True], times[False], strict=True)
        )
        - 1.0,
    }


def bench_split(args: argparse.Namespace, samples: dict[str, Any]) -> dict[str, Any]:
    """Packing and client decode of the 64 replies, routes on vs off, alternated."""
    import dataclasses

    from inference.client.client import _parse_generate_reply
    from inference.server.render import render_generate_reply

    reqs, outs = samples["requests"], samples["outputs"]
    plain = [dataclasses.replace(r, return_routed_experts=False) for r in reqs]
    bare = [dataclasses.replace(o, routed_experts=None) for o in outs]

    def pack(on: bool) -> tuple[float, list[bytes]]:
        t0 = time.perf_counter()
        if on:  # what training asks for: routes and the fully packed body
            bodies = [
                render_generate_reply(o, r, model="m", side_channels=True, packed_body=True)[0]
                for o, r in zip(outs, reqs, strict=True)
            ]
        else:
            bodies = [
                render_generate_reply(o, r, model="m", side_channels=False)[0]
                for o, r in zip(bare, plain, strict=True)
            ]
        return time.perf_counter() - t0, bodies

    def decode(on: bool, bodies: list[bytes]) -> float:
        t0 = time.perf_counter()
        for body, r in zip(bodies, reqs, strict=True):
            _parse_generate_reply(
                body,
                packed=on,
                want_routes=on,
                want_support=False,
                packed_body=on,
                prompt_route_rows=len(r.prompt_token_ids) - 1 if on else None,
            )
        return time.perf_counter() - t0

    times: dict[str, dict[bool, list[float]]] = {"pack": {}, "decode": {}}
    sizes: dict[bool, int] = {}
    for _ in range(args.repeats):
        for on in (False, True):
            dt, bodies = pack(on)
            times["pack"].setdefault(on, []).append(dt)
            times["decode"].setdefault(on, []).append(decode(on, bodies))
            sizes[on] = sum(len(b) for b in bodies)
    out: dict[str, Any] = {"body_bytes_off": sizes[False], "body_bytes_on": sizes[True]}
    for part, by_arm in times.items():
        off, on = statistics.median(by_arm[False]), statistics.median(by_arm[True])
        out[f"{part}_off_s"], out[f"{part}_on_s"], out[f"{part}_extra_s"] = off, on, on - off
    return out


async def _http(args: argparse.Namespace) -> dict[str, Any]:
    from inference.client import GenerateRequest, RemoteGenerateClient
    from inference.server import EngineSpec, ServerConfig, ServerThread

    batches: list[int] = []  # the size of every forward batch the engine ran
    engines: list[Any] = []

    def build() -> Any:
        engine = EngineSpec(seed=0, max_batch_size=args.requests, batch_window_ms=1000.0).build()
        run_batch = engine._run

        def counted(requests: list[Any]) -> Any:
            batches.append(len(requests))
            return run_batch(requests)

        engine._run = counted  # how the batching window grouped the arrivals
        engines.append(engine)
        return engine

    server = ServerThread(build, ServerConfig())
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
                        return_packed_body=capture,  # as training asks (generators)
                    )
                    for i, p in enumerate(prompts)
                ]

            splits: dict[bool, list[int]] = {False: [], True: []}

            async def run(capture: bool, concurrency: int) -> tuple[float, list[Any]]:
                reqs = requests(capture)
                del batches[:]
                t0 = time.perf_counter()
                results = await client.generate_batch(reqs, max_concurrency=concurrency)
                dt = time.perf_counter() - t0
                splits[capture].append(len(batches))
                return dt, results

            await run(False, args.requests)  # warm-up
            splits[False].clear()
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

            # Concurrency: a sequential slice of the workload vs all of it at once. One
            # request at a time never fills a batch: back to the default window.
            engines[0].batch_window_ms = EngineSpec.batch_window_ms
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
        # Each repeat's on/off pair ran back to back: their ratio cancels the slower
        # drifts (another process, a frequency change) that the two medians do not.
        "overhead_paired": statistics.median(
            a / b for a, b in zip(times[True], times[False], strict=True)
        )
        - 1.0,
        "forward_batches_off": splits[False],
        "forward_batches_on": splits[True],
        "sequential_requests": seq_n,
        "sequential_tok_per_s": sequential_tps,
        "concurrency_speedup": concurrent_tps / sequential_tps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-http", action="store_true", help="engine-level figures only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from skyrl_train.utils.cpu_topology import cpu_model

    samples: dict[str, Any] = {}
    report: dict[str, Any] = {
        "cpu": cpu_model(),
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
        "engine": bench_engine(args, samples),
    }
    report["split"] = bench_split(args, samples)
    if not args.skip_http:
        report["http"] = asyncio.run(_http(args))
        h, e, sp = report["http"], report["engine"], report["split"]
        base = h["off_s"]["median"]
        extra = h["on_s"]["median"] - base
        capture = e["on_s"]["median"] - e["off_s"]["median"]
        rest = extra - capture - sp["pack_extra_s"] - sp["decode_extra_s"]
        report["http_split_pct"] = {
            "total": 100 * extra / base,
            "capture": 100 * capture / base,
            "packing": 100 * sp["pack_extra_s"] / base,
            "client_decode": 100 * sp["decode_extra_s"] / base,
            "transfer_and_rest": 100 * rest / base,
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['cpu']}  python {report['python']}  torch {report['torch']}  transformers "
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
            f"  R3 overhead {100 * r['overhead']:+.1f}% (median of paired repeats "
            f"{100 * r['overhead_paired']:+.1f}%)  (tokens identical: yes)"
        )
    sp = report["split"]
    print(
        f"[split] packing {sp['pack_off_s'] * 1e3:.1f} -> {sp['pack_on_s'] * 1e3:.1f} ms, "
        f"client decode {sp['decode_off_s'] * 1e3:.1f} -> {sp['decode_on_s'] * 1e3:.1f} ms, "
        f"bodies {sp['body_bytes_off'] / 1e6:.2f} -> {sp['body_bytes_on'] / 1e6:.2f} MB"
    )
    if "http_split_pct" in report:
        parts = report["http_split_pct"]
        print(
            "[http] overhead split, % of the off arm's time: "
            + ", ".join(f"{name} {value:+.1f}" for name, value in parts.items())
        )
    if "http" in report:
        h = report["http"]
        print(
            f"[http] {h['sequential_requests']} sequential requests: "
            f"{h['sequential_tok_per_s']:.0f} tok/s; {args.requests} concurrent: "
            f"{h['on_tok_per_s']:.0f} tok/s; speedup {h['concurrency_speedup']:.1f}x"
        )
        print(
            f"[http] forward batches per repeat (64 requests): off {h['forward_batches_off']}, "
            f"on {h['forward_batches_on']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
