"""The observation renderer appends tokens; it never re-renders the conversation."""

from __future__ import annotations

import pytest

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


# Qwen3-style: earlier assistant turns are re-rendered without their reasoning block,
# so re-rendering a conversation rewrites tokens the policy already sampled.
STRIPS_HISTORY = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}"
    "{{- '<|im_start|>assistant\\n' + (m['content'].split('</think>')[-1] | trim) + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Marks only the latest user message: appending a message changes an earlier one.
MARKS_LATEST = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + ('[latest] ' if loop.index0 == ns.last else '')"
    " + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _with_template(template: str):
    from inference.models.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = template
    return tok


def test_a_template_that_rewrites_history_is_handled_by_the_token_history():
    tok = _with_template(STRIPS_HISTORY)
    renderer = ChatTemplateRenderer(tok)
    start = renderer.initial(PROMPT)
    reply = list(b"<think>odd</think> 7") + [IM_END_TOKEN_ID]
    ids = renderer.extend(start + reply, OBS)
    # The sampled turn is kept token for token (its routes stay aligned) ...
    assert ids[: len(start) + len(reply)] == start + reply
    # ... although re-rendering the conversation would have dropped the reasoning.
    rerendered = tok.apply_chat_template(
        [*PROMPT, {"role": "assistant", "content": "<think>odd</think> 7"}, *OBS],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<think>" not in rerendered and "<think>" in tok.decode(ids)
    assert tok.decode(ids).endswith("<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_whose_observation_rewrites_earlier_text_raises_clearly():
    renderer = ChatTemplateRenderer(_with_template(MARKS_LATEST))
    start = renderer.initial(PROMPT)
    with pytest.raises(ValueError, match="expected the observation to extend the rendering"):
        renderer.extend(start + [ord("7"), IM_END_TOKEN_ID], OBS)
