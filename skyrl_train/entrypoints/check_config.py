"""``python -m skyrl_train.entrypoints.check_config [--prompt-tokens N] [key=value ...]``:
check a launch config without launching it.

Composes the config as ``main_base`` does (the same overrides, groups and presets),
runs the launch's whole validation (``validate_cfg``) with ``model.path`` needing only
its ``config.json`` (no tokenizer, no weights: the model may live on the cluster), and
prints the layout each trainer rank would build with a memory estimate
(``config.layout_report``). A refused config prints the ``ConfigValidationError``,
which names the key, what was expected and what was found, and exits 1.

    python -m skyrl_train.entrypoints.check_config model.path=DIR preset=qwen3_30b_a3b_8gpu

``--prompt-tokens N`` adds N prompt tokens per trajectory to the route estimate
(``generator.max_response_tokens`` is the rest); the prompts' length is the data's. A
count that is not one exits 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from skyrl_train.config.compose import load_config
from skyrl_train.config.layout_report import LayoutReport, layout_report
from skyrl_train.config.model_source import model_architecture
from skyrl_train.config.paths import resolve_paths
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError

PROMPT_TOKENS = "--prompt-tokens"


def check_config(overrides: Sequence[str], *, prompt_tokens: int = 0) -> LayoutReport:
    """The layout report of the config ``overrides`` compose, after the launch's
    validation (raises ``ConfigValidationError`` where the launch would refuse it)."""
    cfg = resolve_paths(load_config(overrides))
    validate_cfg(cfg, config_only=True)
    arch = model_architecture(cfg.model, config_only=True)
    return layout_report(cfg, arch, prompt_tokens=prompt_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit code (0: accepted, 1: refused)."""
    args = list(sys.argv[1:] if argv is None else argv)
    prompt_tokens = 0
    overrides: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == PROMPT_TOKENS or arg.startswith(PROMPT_TOKENS + "="):
            value = arg.partition("=")[2] if "=" in arg else next(it, "")
            if not value.isdigit():
                print(f"error: {PROMPT_TOKENS}: expected a count of tokens, got {value!r}")
                return 2
            prompt_tokens = int(value)
        else:
            overrides.append(arg)
    try:
        report = check_config(overrides, prompt_tokens=prompt_tokens)
    except ConfigValidationError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    print(report.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
