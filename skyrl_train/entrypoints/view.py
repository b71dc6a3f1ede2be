"""``python -m skyrl_train.entrypoints.view RUN_DIR [RUN_DIR ...]``: look at runs in a browser.

Writes an offline page (``<first RUN_DIR>/view/index.html``, or ``--out DIR``) and
prints its path: open it as a plain file, no server or network needed. ``--serve``
serves the same page on 127.0.0.1 (``--port``, default 8765; 0 takes a free one)
until Ctrl-C, reading each step's dump when the page asks for it.

The page: the metrics over steps as Plotly plots (several runs overlaid), and per
step with a rollout dump (``logging.dump_rollouts``) its trajectories by GRPO group,
each one's tokens coloured by |rollout - trainer log-prob| or advantage, the MoE
layers whose routers disagreed per token, and the step's expert load.

Exit status 2 for a path that is not a run folder; a torn metrics line or a dump that
cannot be read is a warning naming the file (the page shows the message at that step).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skyrl_train.viewer.inputs import NotARunError, load_runs
from skyrl_train.viewer.serve import NotLoopbackError, check_host, serve
from skyrl_train.viewer.site import write_site

DEFAULT_PORT = 8765


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m skyrl_train.entrypoints.view",
        description="Write (or serve on 127.0.0.1) a page of runs' metrics and rollout dumps.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--out", type=Path, help="folder for the page (default: <first RUN_DIR>/view)"
    )
    parser.add_argument("--serve", action="store_true", help="serve the page until Ctrl-C")
    parser.add_argument("--host", default="127.0.0.1", help="only 127.0.0.1 (or localhost)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="with --serve; 0: any free")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_host(args.host)
        runs = load_runs(args.run_dirs)
    except (NotARunError, NotLoopbackError) as exc:
        print(f"view: {exc}", file=sys.stderr)
        return 2
    if args.serve:
        if args.out is not None:
            print(
                "view: --out: expected no folder with --serve (it writes nothing)", file=sys.stderr
            )
            return 2
        for warning in (w for run in runs for w in run.warnings):
            print(f"view: warning: {warning}", file=sys.stderr)
        try:
            serve(args.run_dirs, host=args.host, port=args.port)
        except OSError as exc:
            print(f"view: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        return 0
    out = args.out if args.out is not None else args.run_dirs[0] / "view"
    try:
        warnings = write_site(runs, out)
    except OSError as exc:
        print(f"view: {out}: cannot write the page: {exc}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"view: warning: {warning}", file=sys.stderr)
    print(out.resolve() / "index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
