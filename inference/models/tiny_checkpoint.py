"""Small random checkpoints of every supported family, written as real folders.

``write_tiny_checkpoint("olmoe", out)`` writes what a downloaded checkpoint holds:
``config.json`` and ``generation_config.json``, fp32 ``model.safetensors`` drawn from
a fixed torch seed, and a byte-level BPE tokenizer trained here, offline, on a small
built-in English and arithmetic corpus. The engine, the trainer and
``inspect_checkpoint`` then read it like any other folder, so every family can be
served and trained in tests without a download (``scripts/make_checkpoint.py``).

Token choices:

- ``<|endoftext|>`` (id 0) pads and ends a document; ``<|im_start|>`` (1) and
  ``<|im_end|>`` (2) frame ChatML turns (``inference.models.tokenizer.CHAT_TEMPLATE``).
- The tokenizer's EOS is ``<|im_end|>``: it is what closes the assistant turn a chat
  rollout generates, and it differs from the pad token, so a loss or attention mask
  built from ``pad_token_id`` can never drop a real EOS. ``generation_config.json``
  lists both ids, so a turn stops at either (the engine reads that list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.models.architecture import TinySizes
from inference.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
)

__all__ = ["TINY_SPECIAL_TOKENS", "build_bpe_tokenizer", "tiny_corpus", "write_tiny_checkpoint"]

TINY_SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
"""Ids 0, 1, 2 in this order: the trainer places special tokens first."""

_ENGLISH = """\
The quick brown fox jumps over the lazy dog while the farmer counts his sheep.
A small model can still learn the shape of a sentence, one token at a time.
She opened the window, looked at the rain, and decided to stay inside and read.
Every morning the baker makes bread, and every evening the shop sells what is left.
If you add two numbers and then subtract the second one, you get the first number back.
The answer is the number you get after you follow each step of the question carefully.
Please show your work, then write the final answer on the last line.
Tom has three apples. He buys four more apples at the market. How many apples does he have?
Anna reads twelve pages a day. How many pages does she read in a week of seven days?
A train leaves the station at nine o'clock and arrives two hours later, at eleven.
The teacher asked the class to explain why the sum of two even numbers is always even.
We think, we check, and then we answer: that is how a careful student solves a problem.
The user asks a question and the assistant answers it in a short, helpful way.
Hello! How can I help you today? Let me think about that for a moment.
Thank you for the question. Here is a step by step solution to the problem.
"""


def tiny_corpus() -> list[str]:
    """The training lines: English sentences, then arithmetic facts and word problems.

    Fixed text and loops, no randomness: the corpus, and so the tokenizer, is the same
    on every machine.
    """
    lines = _ENGLISH.splitlines()
    for a in range(0, 30):
        for b in range(0, 30, 7):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a + b} - {b} = {a}")
            lines.append(f"{a} * {b} = {a * b}")
    for n in range(2, 40, 3):
        lines.append(
            f"Question: What is {n} plus {n + 5}? Answer: {n} + {n + 5} = {2 * n + 5}. "
            f"The answer is {2 * n + 5}."
        )
        lines.append(f"If one box holds {n} pens, then 3 boxes hold 3 * {n} = {3 * n} pens.")
    return lines


def build_bpe_tokenizer(vocab_size: int, *, max_length: int = 1 << 30) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens.

    Byte level: the 256-symbol byte alphabet is always in the vocabulary and there is
    no normaliser, so any text, including non-ASCII, encodes and decodes exactly.
    Trained by ``tokenizers``' ``BpeTrainer`` on ``tiny_corpus()``; the trainer has no
    randomness, breaks count ties by pair ids, and assigns the byte alphabet sorted,
    so the result is the same on every run (tested).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(TINY_SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size: expected >= {minimum} (256 bytes and {len(TINY_SPECIAL_TOKENS)} "
            f"special tokens), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


def write_tiny_checkpoint(
    family: str, out: str | Path, *, seed: int = 0, sizes: TinySizes = TinySizes()
) -> Path:
    """Writes a random fp32 checkpoint of ``family`` with a trained BPE tokenizer.

    ``out`` is created; an existing folder must be empty (a stale ``tokenizer.model``
    or shard left there would be read with the new files). The weights are
    ``AutoModelForCausalLM.from_config(family.tiny_config(sizes))`` drawn under
    ``torch.manual_seed(seed)`` (the caller's RNG state is restored). Returns ``out``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from inference.models.families import family_named

    spec = family_named(family)
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"out: expected a new or empty folder, got {str(path)!r}")
    tokenizer = build_bpe_tokenizer(sizes.vocab_size, max_length=sizes.max_position_embeddings)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (IM_END_TOKEN, EOS_TOKEN)]
    pad_id = tokenizer.pad_token_id

    config = spec.tiny_config(sizes)
    config.eos_token_id = eos_ids[0]
    config.pad_token_id = pad_id
    config.bos_token_id = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
