"""Write a tiny random checkpoint of one MoE family, for tests and local runs.

    python scripts/make_checkpoint.py --family olmoe --out /tmp/olmoe-tiny [--seed 0]
        [--size head_dim=64 ...]

``--size FIELD=INT`` overrides one ``TinySizes`` field (repeatable). For vLLM on CPU:
its attention refuses head_dim 8 and 16 but serves 64, and its MoE kernel wants the
hidden width divisible by 32, so ``--size head_dim=64 --size hidden_size=64``.

The folder (config, fp32 safetensors, a byte-level BPE tokenizer with a ChatML chat
template) is what ``python -m inference.server --checkpoint DIR`` and the trainer's
``model.path`` take; see ``inference.models.tiny_checkpoint`` for the token choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.models.architecture import TinySizes  # noqa: E402
from inference.models.checkpoint import (  # noqa: E402
    inspect_checkpoint,
)
from inference.models.families import FAMILIES  # noqa: E402
from inference.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

_INT_SIZES = tuple(f.name for f in dataclasses.fields(TinySizes) if f.type in (int, "int"))


def parse_sizes(items: list[str]) -> TinySizes:
    """``["head_dim=64", ...]`` -> ``TinySizes`` with those integer fields replaced."""
    overrides: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in _INT_SIZES:
            raise ValueError(
                f"--size: expected FIELD=INT with FIELD one of {list(_INT_SIZES)}, got {item!r}"
            )
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--size {key}: expected an integer, got {value!r}") from None
        if number <= 0:
            raise ValueError(f"--size {key}: expected a positive integer, got {number}")
        overrides[key] = number
    return dataclasses.replace(TinySizes(), **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/make_checkpoint.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", required=True, type=Path, help="a new or empty folder")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    parser.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="override one TinySizes field, e.g. head_dim=64 (repeatable)",
    )
    args = parser.parse_args(argv)

    try:
        sizes = parse_sizes(args.size)
        path = write_tiny_checkpoint(args.family, args.out, seed=args.seed, sizes=sizes)
    except (FileExistsError, ValueError) as exc:
        parser.error(str(exc))
    info = inspect_checkpoint(path)  # what every consumer will read back
    arch = info.architecture
    dense = list(arch.dense_layers) or "none"
    shared = arch.shared_expert_ffn_hidden_size
    print(f"wrote {path}")
    print(f"family        {info.family.name} ({', '.join(info.family.architectures)})")
    print(
        f"layers        {arch.num_layers} (MoE {list(arch.moe_layers)}, dense {dense}), "
        f"hidden {arch.hidden_size}, heads {arch.num_attention_heads}/{arch.num_kv_heads} "
        f"of {arch.head_dim}, q/k norm {arch.qk_norm}"
    )
    print(
        f"experts       {arch.num_experts} x {arch.moe_ffn_hidden_size} wide, top-{arch.num_experts_per_tok}, "
        f"renormalised {arch.norm_topk_prob}, shared expert {shared or 'none'}"
    )
    tokenizer = info.tokenizer
    eos = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)}" for i in info.eos_token_ids)
    pad = f"{info.pad_token_id} {tokenizer.convert_ids_to_tokens(info.pad_token_id)}"
    print(f"vocab         tokenizer {info.tokenizer_size} of embedding {arch.vocab_size}")
    print(f"specials      eos [{eos}], pad {pad}; weights seed {args.seed}")
    for file in sorted(path.iterdir()):
        print(f"  {file.name:<24} {file.stat().st_size:>10,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
