"""Which letters a trained `repeat_letter` policy copies: greedy play of every task.

    python scripts/letters_copied.py runs/r3_grpo/exports/global_step_150

Plays all 8**3 three-letter tasks greedily on a Hugging Face export, with the
environment itself writing each observation and the generator's own renderer laying
out the tokens. Prints the share of turns copied right per letter, per context (the
first turn, after a right reply, after "no. x") and per turn. It prints the commonest
wrong replies as well. A run that plateaus at 0.667 (docs/experiments.md, "Every seed
to 0.8") copies most letters every time and never copies one or two.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_gym.envs.repeat_letter import ALPHABET, RepeatLetterEnv  # noqa: E402
from skyrl_train.generators.rendering import ChatTemplateRenderer  # noqa: E402

TURNS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a Hugging Face export folder")
    parser.add_argument("--worst", type=int, default=10, help="wrong replies to list")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.export)
    model = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32).eval()
    renderer = ChatTemplateRenderer(tokenizer)
    right: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    wrong: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for letters in itertools.product(ALPHABET, repeat=TURNS):
        env = RepeatLetterEnv(extras={"letters": "".join(letters)})
        prompt, _ = env.init([{"role": "user", "content": f"Repeat: {letters[0]}"}])
        ids = renderer.initial(prompt)
        context = "first"
        for turn, letter in enumerate(letters):
            with torch.no_grad():
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            reply = tokenizer.decode([token])
            out = env.step(reply)
            correct = bool(out["metadata"]["correct"])
            for key in (f"letter {letter}", f"context {context}", f"turn {turn}"):
                right[key][0] += correct
                right[key][1] += 1
            if not correct:
                wrong[(context, letter, reply)] += 1
            ids = renderer.extend([*ids, token], out["observations"])
            context = "after right" if correct else "after wrong"
    for key in sorted(right):
        hits, turns = right[key]
        print(f"{key:22s} {hits / turns:.2f} of {turns} turns")
    print("commonest wrong replies (context, shown, reply): count")
    for (context, letter, reply), count in wrong.most_common(args.worst):
        print(f"  {context}, {letter}, {reply!r}: {count}")


if __name__ == "__main__":
    main()
