"""The byte-level tokenizer shared by the engine, the generator and the trainer.

Token id ``b`` is byte ``b`` (0..255), so any UTF-8 text round-trips exactly and the
vocabulary never needs training or a download. Special tokens follow at 256..263,
which is why ``TinyMoEConfig.vocab_size`` defaults to 264.

The tokenizer is built in code with ``tokenizers`` (a BPE model with no merges over
the GPT-2 byte alphabet), wrapped in a transformers fast tokenizer, and saved as an
ordinary folder that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "IM_END_TOKEN",
    "IM_END_TOKEN_ID",
    "IM_START_TOKEN",
    "IM_START_TOKEN_ID",
    "NUM_BYTE_TOKENS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_byte_tokenizer",
    "load_tokenizer",
    "save_byte_tokenizer",
]

NUM_BYTE_TOKENS = 256
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Reserved slots keep the vocabulary at 264 so later specials (tool calls, images)
# can be named without resizing every checkpoint's embedding.
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    *(f"<|reserved_{i}|>" for i in range(5)),
)
EOS_TOKEN_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(EOS_TOKEN)
IM_START_TOKEN_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(IM_START_TOKEN)
IM_END_TOKEN_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(IM_END_TOKEN)
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# ChatML-like: every message is "<|im_start|>{role}\n{content}<|im_end|>\n"; the
# generation prompt opens an assistant turn. Re-rendering a longer conversation
# extends the previous rendering token for token, which the multi-turn route trace
# relies on (a re-render that rewrites earlier tokens would misalign routes).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def _byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-printable-character table, indexed by byte value.

    The ByteLevel pre-tokenizer and decoder of ``tokenizers`` use exactly this table,
    so a vocabulary keyed by it gives token id == byte value.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in table:
            table[b] = chr(NUM_BYTE_TOKENS + shift)
            shift += 1
    return [table[b] for b in range(NUM_BYTE_TOKENS)]


def _build_backend() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # use_regex=False: no word splitting is needed when every byte is its own token,
    # and skipping the regex keeps encoding linear and fast on long observations.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added = tok.add_special_tokens(list(SPECIAL_TOKENS))
    if added != len(SPECIAL_TOKENS) or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"byte tokenizer: expected vocab {VOCAB_SIZE}, got {tok.get_vocab_size()}"
        )
    return tok


def build_byte_tokenizer() -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` over bytes, eos = pad = id 256."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_build_backend(),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    return tokenizer


def save_byte_tokenizer(folder: str | Path) -> Path:
    """Writes the byte tokenizer into ``folder`` (created if missing); returns the path."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save_pretrained(str(path))
    return path


def load_tokenizer(folder: str | Path | None = None) -> Any:
    """Loads a tokenizer folder with ``AutoTokenizer``; ``None`` builds the byte tokenizer.

    Only local files are read (``local_files_only=True``): a missing folder fails
    here instead of silently reaching for the hub.
    """
    if folder is None:
        return build_byte_tokenizer()
    from transformers import AutoTokenizer

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder: expected a directory, got {str(path)!r}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
