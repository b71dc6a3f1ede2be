"""Turning chat messages into prompt tokens, once per message, never re-rendering.

Re-rendering a whole conversation each turn is how earlier systems broke multi-turn
routes: a template that strips whitespace, or bytes that decode to U+FFFD and
re-encode differently, rewrites earlier tokens, and every route row after the change
belongs to a different token. Here the policy's tokens are kept as sampled and each
observation is rendered once and appended; the generator still checks, per turn, that
the new prompt extends the previous tokens (``ObservationRenderer`` is injectable so
a test can hand it a renderer that breaks the rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
# Any short message works as a rendering anchor; only the suffix after it is kept.
_ANCHOR: list[Message] = [{"role": "user", "content": "x"}]


@runtime_checkable
class ObservationRenderer(Protocol):
    """What the generator needs from a chat template."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a policy turn (sent as stop ids, kept in the response)."""
        ...

    def initial(self, prompt: Sequence[Message]) -> list[int]:
        """The first prompt: the messages plus the assistant generation prompt."""
        ...

    def extend(self, token_ids: Sequence[int], observations: Sequence[Message]) -> list[int]:
        """The next prompt: ``token_ids`` (the whole conversation so far, last policy
        turn included) followed by the observation messages and a generation prompt."""
        ...


class ChatTemplateRenderer:
    """``ObservationRenderer`` over a transformers tokenizer's chat template.

    The tokens that close an assistant turn and open an observation are found once, by
    rendering around an anchor conversation and keeping the difference; that works for
    templates where appending a message appends text (ChatML and the byte tokenizer's).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        anchor = self._text(_ANCHOR, generation_prompt=False)
        opened = self._text(_ANCHOR, generation_prompt=True)
        closed = self._text(
            [*_ANCHOR, {"role": "assistant", "content": ""}], generation_prompt=False
        )
        gen_prompt = self._suffix(anchor, opened, "generation prompt")
        close = self._suffix(anchor + gen_prompt, closed, "assistant turn close")
        self._closed_anchor = closed
        self._close_ids = self._encode(close)
        if not self._close_ids:
            raise ValueError(
                "ChatTemplateRenderer: expected the template to close an assistant turn "
                "with at least one token, got none"
            )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._close_ids[0],)

    def _text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _suffix(base: str, longer: str, what: str) -> str:
        if not longer.startswith(base):
            raise ValueError(
                f"ChatTemplateRenderer: expected the {what} to extend the rendering before "
                f"it, got {longer!r} after {base!r}"
            )
        return longer[len(base) :]

    def initial(self, prompt: Sequence[Message]) -> list[int]:
        return self._encode(self._text(prompt, generation_prompt=True))

    def observation_ids(self, observations: Sequence[Message]) -> list[int]:
        """The observation messages and the next generation prompt, as tokens."""
        if not observations:
            return []
        full = self._text(
            [*_ANCHOR, {"role": "assistant", "content": ""}, *observations], generation_prompt=True
        )
        return self._encode(self._suffix(self._closed_anchor, full, "observation"))

    def extend(self, token_ids: Sequence[int], observations: Sequence[Message]) -> list[int]:
        ids = list(token_ids)
        # A turn that ended on its stop token (<|im_end|>) only needs the rest of the
        # close ("\n"); one cut by max_tokens needs the whole close.
        close = self._close_ids[1:] if ids and ids[-1] == self._close_ids[0] else self._close_ids
        return ids + close + self.observation_ids(observations)
