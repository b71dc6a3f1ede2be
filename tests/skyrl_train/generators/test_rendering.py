"""The observation renderer appends tokens; it never re-renders the conversation."""

from __future__ import annotations

from inference.models.tokenizer import IM_END_TOKEN_ID
from skyrl_train.generators import ChatTemplateRenderer, ObservationRenderer

PROMPT = [{"role": "user", "content": "3+4="}]
OBS = [{"role": "user", "content": "higher"}]


def test_initial_prompt_is_the_chat_template_with_a_generation_prompt(tokenizer):
    renderer = ChatTemplateRenderer(tokenizer)
    assert isinstance(renderer, ObservationRenderer)
    assert renderer.stop_token_ids == (IM_END_TOKEN_ID,)
    text = tokenizer.decode(renderer.initial(PROMPT))
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


def test_extend_closes_the_turn_once_and_appends_the_observation(tokenizer):
    renderer = ChatTemplateRenderer(tokenizer)
    start = renderer.initial(PROMPT)
    tail = "<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    # The policy ended its turn itself: only the newline of the close is added.
    ended = renderer.extend(start + [ord("7"), IM_END_TOKEN_ID], OBS)
    assert ended[: len(start) + 2] == start + [ord("7"), IM_END_TOKEN_ID]
    assert tokenizer.decode(ended[len(start) + 2 :]) == "\n" + tail
    # A reply cut by max_tokens (here invalid UTF-8) is closed by the renderer and kept
    # byte for byte; a re-render from decoded text would have turned it into U+FFFD.
    cut = renderer.extend(start + [0xFF, 0xFE], OBS)
    assert cut[: len(start) + 2] == start + [0xFF, 0xFE]
    assert tokenizer.decode(cut[len(start) + 2 :]) == "<|im_end|>\n" + tail
    # The whole conversation matches what the template renders for well-formed text.
    full = tokenizer.apply_chat_template(
        [*PROMPT, {"role": "assistant", "content": "7"}, *OBS],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tokenizer.decode(ended) == full
    assert renderer.observation_ids([]) == []
