"""The byte tokenizer: exact round-trips, ids, AutoTokenizer loading, chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.models.tiny_moe import TinyMoEConfig
from inference.models.tokenizer import (
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
    load_tokenizer,
    save_byte_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("tok") / "byte")


def test_ids_are_bytes_and_specials_follow(tokenizer) -> None:
    text = "aé 🤖\n\t  x"
    assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert (EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID) == (256, 257, 258)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 256
    assert len(tokenizer) == VOCAB_SIZE == TinyMoEConfig().vocab_size == 264
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_roundtrip_any_text(tokenizer, text: str) -> None:
    tok = tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == text


def test_special_token_text_is_one_token(tokenizer) -> None:
    ids = tokenizer.encode("a<|im_end|>b", add_special_tokens=False)
    assert ids == [97, IM_END_TOKEN_ID, 98]
    assert tokenizer.decode(ids) == "a<|im_end|>b"


def test_autotokenizer_loads_saved_folder(saved, tokenizer) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    text = "héllo <|im_start|> wörld"
    assert auto.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert auto.eos_token_id == 256 and auto.pad_token_id == 256
    assert load_tokenizer(saved).decode(auto.encode(text, add_special_tokens=False)) == text


def test_load_tokenizer_missing_folder_fails_loudly(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer folder"):
        load_tokenizer(tmp_path / "absent")


def test_chat_template_and_generation_prompt(saved) -> None:
    tok = load_tokenizer(saved)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(msgs, tokenize=False)
    assert not plain.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START_TOKEN_ID and ids.count(IM_END_TOKEN_ID) == 2
    # Adding a turn extends the earlier rendering token for token (multi-turn routes).
    longer = tok.apply_chat_template([*msgs, {"role": "user", "content": "more"}], tokenize=False)
    assert longer.startswith(plain)
