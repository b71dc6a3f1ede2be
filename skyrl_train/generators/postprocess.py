"""An environment's ``postprocessed_action``: the text that stands for the last reply.

SkyRL re-encodes the new text and trains on those tokens, which the engine never
sampled (no logprobs of theirs, no routes: SkyRL refuses R3 with it). Here the
sampled tokens whose text the replacement keeps (the longest prefix of the reply that
is a prefix of the replacement) stay as they were: they train, with their logprobs
and their route rows. The rest of the reply is dropped, tokens and route rows, and
the replacement's remaining text is appended as environment tokens (loss mask 0), so
the conversation reads exactly the replacement and the next prompt still extends the
tokens kept. The usual case, a reply cut after its tool call, drops only a tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skyrl_train.generators.trajectory import Trajectory


def kept_prefix(tokenizer: Any, generated: Sequence[int], replacement: str) -> tuple[int, str]:
    """(k, text): the fewest leading tokens of ``generated`` that decode to the longest
    text that is a prefix of ``replacement``, and that text. Binary search: a longer
    token prefix decodes to a longer text, so the property holds for every k up to the
    largest; tokens that decode to nothing (special tokens) are then not kept."""

    def text(k: int) -> str:
        return tokenizer.decode(list(generated[:k]), skip_special_tokens=True)

    low, high = 0, len(generated)
    while low < high:
        mid = (low + high + 1) // 2
        if replacement.startswith(text(mid)):
            low = mid
        else:
            high = mid - 1
    kept = text(low)
    while low > 0 and text(low - 1) == kept:  # a trailing special token adds no text
        low -= 1
    return low, kept


def replace_reply(
    traj: Trajectory,
    tokenizer: Any,
    *,
    generated: Sequence[int],
    replacement: str,
    prompt_tokens: int,
) -> int:
    """Make ``replacement`` the text of the reply just appended to ``traj`` (its
    ``generated`` tokens, sent after ``prompt_tokens`` tokens); returns the response
    position of the turn's last kept sampled token, where its reward belongs (the
    last response token when none was kept)."""
    keep, kept_text = kept_prefix(tokenizer, generated, replacement)
    dropped = len(generated) - keep
    if dropped:
        traj.truncate(len(traj.response_ids) - dropped)
        if traj.trace is not None:
            # Rows of the prompt and the kept tokens; the last kept token's row is the
            # routing it got when fed, in the same context, so it stays.
            traj.trace.truncate(prompt_tokens + keep)
    last_kept = len(traj.response_ids) - 1
    rest = replacement[len(kept_text) :]
    ids = list(tokenizer.encode(rest, add_special_tokens=False)) if rest else []
    if ids:
        traj.append(ids, mask=0, logprobs=[0.0] * len(ids))
    traj.postprocessed_turns += 1
    return last_kept if keep else len(traj.response_ids) - 1
