"""Tiny checkpoints of every family: inspectable folders with a trained BPE tokenizer.

Serving them is tested in tests/inference/engine/test_families.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.models.architecture import TinySizes
from inference.models.checkpoint import inspect_checkpoint, load_checkpoint_tokenizer
from inference.models.families import FAMILIES
from inference.models.tiny_checkpoint import (
    TINY_SPECIAL_TOKENS,
    build_bpe_tokenizer,
    write_tiny_checkpoint,
)

REPO = Path(__file__).resolve().parents[3]
FAMILY_NAMES = tuple(FAMILIES)

TEXTS = [
    "",
    "Hello, world! 12 + 7 = 19",
    "  leading and trailing spaces  \n\n\ttabs\r\nwindows lines",
    "héllo wörld — naïve café, 你好世界, こんにちは, Привет, مرحبا, 🤗🚀 e\u0301 (combining)",
    "\x00\x01 control bytes \x7f and a lone surrogate-free astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nliteral specials survive<|im_end|>\n<|endoftext|>",
]


@functools.cache
def _tokenizer():
    return build_bpe_tokenizer(TinySizes().vocab_size)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_written_checkpoint_is_inspectable(tiny_checkpoints, family: str) -> None:
    sizes = TinySizes()
    info = inspect_checkpoint(tiny_checkpoints[family])
    arch = info.architecture
    assert info.family.name == arch.family == family
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers) == (512, 48, 3)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_ffn_hidden_size) == (6, 3, 32)
    # Qwen families take a dense first layer; OLMoE and Mixtral have none.
    dense = (0,) if family in ("qwen3_moe", "qwen2_moe") else ()
    assert arch.dense_layers == dense
    assert arch.num_moe_layers == sizes.num_layers - len(dense)
    assert info.tokenizer_size <= sizes.vocab_size
    # <|im_end|> first (the tokenizer's EOS), then <|endoftext|> (the pad).
    assert info.eos_token_ids == (2, 0) and info.pad_token_id == 0
    generation = json.loads((tiny_checkpoints[family] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    assert not list(tiny_checkpoints[family].glob("tiny_moe_config.json"))


def test_tokenizer_specials_and_size(tokenizer) -> None:
    assert len(tokenizer) <= TinySizes().vocab_size
    assert tokenizer.convert_tokens_to_ids(list(TINY_SPECIAL_TOKENS)) == [0, 1, 2]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # Merges were learned: a frequent corpus word is one or two tokens, not its bytes.
    assert len(tokenizer.encode("the answer is")) < len("the answer is")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = _tokenizer()  # hypothesis refuses function-scoped fixtures
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_chatml(tiny_checkpoints) -> None:
    tokenizer = load_checkpoint_tokenizer(tiny_checkpoints["olmoe"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "ünd 4 + 4?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\nünd 4 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|>, <|im_end|> as one id each
    assert tokenizer.decode(ids) == text
    # A longer conversation's rendering extends the shorter one's, token for token.
    shorter = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert text.startswith(shorter)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path) -> None:
    a = write_tiny_checkpoint("qwen3_moe", tmp_path / "a", seed=5)
    b = write_tiny_checkpoint("qwen3_moe", tmp_path / "b", seed=5)
    c = write_tiny_checkpoint("qwen3_moe", tmp_path / "c", seed=6)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert all(_digest(a / n) == _digest(b / n) for n in names)
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    assert _digest(a / "tokenizer.json") == _digest(c / "tokenizer.json")


def test_tokenizer_training_is_deterministic(tokenizer) -> None:
    again = [build_bpe_tokenizer(TinySizes().vocab_size) for _ in range(3)]
    reference = tokenizer.backend_tokenizer.to_str()
    assert all(t.backend_tokenizer.to_str() == reference for t in again)


def test_refuses_a_non_empty_folder_and_a_small_vocab(tmp_path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tokenizer.model").write_text("stale")
    with pytest.raises(FileExistsError, match="new or empty folder"):
        write_tiny_checkpoint("mixtral", tmp_path / "old")
    with pytest.raises(ValueError, match="vocab_size: expected >= 259"):
        write_tiny_checkpoint("mixtral", tmp_path / "new", sizes=TinySizes(vocab_size=200))
    with pytest.raises(ValueError, match="family: expected one of"):
        write_tiny_checkpoint("llama", tmp_path / "new")


def test_make_checkpoint_script_writes_and_describes(tmp_path, capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_checkpoint
    finally:
        sys.path.remove(str(REPO / "scripts"))
    out = tmp_path / "ckpt"
    assert make_checkpoint.main(["--family", "qwen2_moe", "--out", str(out), "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    assert "qwen2_moe (Qwen2MoeForCausalLM)" in printed
    assert "MoE [1, 2], dense [0]" in printed and "shared expert 40" in printed
    assert "eos [2 <|im_end|>, 0 <|endoftext|>], pad 0 <|endoftext|>" in printed
    assert "model.safetensors" in printed and "tokenizer.json" in printed
    assert inspect_checkpoint(out).architecture.family == "qwen2_moe"
    with pytest.raises(SystemExit):
        make_checkpoint.main(["--family", "qwen2_moe", "--out", str(out)])
    assert "new or empty folder" in capsys.readouterr().err


def test_make_checkpoint_script_takes_sizes(tmp_path, capsys) -> None:
    # vLLM's CPU kernels need head_dim 64 and hidden a multiple of 32.
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_checkpoint
    finally:
        sys.path.remove(str(REPO / "scripts"))
    out = tmp_path / "ckpt"
    argv = ["--family", "qwen3_moe", "--out", str(out), "--size", "head_dim=64"]
    assert make_checkpoint.main([*argv, "--size", "hidden_size=64"]) == 0
    arch = inspect_checkpoint(out).architecture
    assert (arch.head_dim, arch.hidden_size, arch.num_experts) == (64, 64, TinySizes().num_experts)
    assert "heads 6/2 of 64" in capsys.readouterr().out
    for bad, message in [
        ("head_dim", "--size: expected FIELD=INT with FIELD one of"),
        ("dense_first_layer=1", "--size: expected FIELD=INT"),
        ("head_dim=x", "--size head_dim: expected an integer, got 'x'"),
        ("head_dim=0", "--size head_dim: expected a positive integer, got 0"),
    ]:
        with pytest.raises(SystemExit):
            make_checkpoint.main(
                ["--family", "qwen3_moe", "--out", str(tmp_path / "n"), "--size", bad]
            )
        assert message in capsys.readouterr().err
