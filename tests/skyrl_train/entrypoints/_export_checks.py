"""Shared by the end-to-end export tests: a run's Hugging Face export checked against
the trainer's own weights (its checkpoint at the same step) and the folder it trained.

The trainer side is rebuilt in this process from the checkpoint's rank file. For the
Megatron backend that is the Megatron model, Megatron parameter names and all: nothing
on that side goes through the HF conversion the export uses, so a wrong name, split or
layout shows in the logits. For the FSDP backend it is a fresh transformers model given
the rank file's tensors directly: nothing on that side goes through the export's
gather and file writing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from inference.models.checkpoint import inspect_checkpoint
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.runs.rank_contract import STRATEGY_KEY
from skyrl_train.runs.rank_file import checkpoint_file, read_plain

TEXTS = ["Tom has 3 apples.", "12 + 7 = 19\nThe answer is 19.", "naïve café ∑"]
CHAT = [
    {"role": "system", "content": "Answer with one letter."},
    {"role": "user", "content": "Which letter comes after A?"},
    {"role": "assistant", "content": "B"},
]


def trainer_logits(checkpoint: Path, model_folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits of rank 0's model in ``checkpoint`` (one rank, no pipeline)."""
    from skyrl_train.workers.megatron import MegatronPolicyWorker
    from skyrl_train.workers.megatron.model import causal_attention_mask

    state = read_plain(checkpoint_file(checkpoint, 0))
    assert state["world_size"] == 1, "the oracle rebuilds a one-rank model"
    if state.get(STRATEGY_KEY) == "fsdp":
        return _fsdp_trainer_logits(state, model_folder, tokens)
    arch = inspect_checkpoint(model_folder).architecture
    worker = MegatronPolicyWorker(arch, MegatronConfig(), routing_replay=False).setup()
    worker.model.load_state_dict(state["model"])
    worker.model.eval()
    rows, seq = tokens.shape
    with torch.no_grad():
        return worker.model(
            tokens, torch.arange(seq)[None].expand(rows, seq), causal_attention_mask(seq)
        )


def _fsdp_trainer_logits(state: dict, model_folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """A one-rank FSDP rank file holds every tensor whole, under transformers' names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_folder), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    with torch.no_grad():
        return model.eval()(tokens).logits


def load_export(folder: Path):  # type: ignore[no-untyped-def]
    """The export as transformers loads it (fp32), refusing a missing or stray tensor."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    missing = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not missing and not info.get("error_msgs"), info
    return model.eval()


def check_export(export: Path, model_folder: Path, checkpoint: Path, tmp: Path) -> float:
    """Everything an export must be; returns the max |logits delta| against the trainer."""
    from transformers import AutoTokenizer

    names = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "skyrl_export.json"} <= names, names
    assert "model.safetensors" in names or "model.safetensors.index.json" in names, names
    assert not list(export.parent.glob("*.tmp-*")), "a temp folder was left beside it"

    hf = load_export(export)
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = hf(tokens).logits
    delta = (ours - trainer_logits(checkpoint, model_folder, tokens)).abs().max().item()
    assert delta <= 1e-5, delta

    # The weights are in save_pretrained's layout: the tensor names the input's files use.
    assert _tensor_names(export) == _tensor_names(model_folder)

    # config.json: the input's, and from_pretrained -> save_pretrained leaves it as it is.
    config = json.loads((export / "config.json").read_bytes())
    assert config == json.loads((model_folder / "config.json").read_bytes())
    hf.save_pretrained(str(tmp / "resaved"))
    assert json.loads((tmp / "resaved" / "config.json").read_bytes()) == config

    # The tokenizer and chat template: the same ids and the same rendering.
    ours_tok = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    theirs = AutoTokenizer.from_pretrained(str(model_folder), local_files_only=True)
    for text in TEXTS:
        assert ours_tok(text)["input_ids"] == theirs(text)["input_ids"], text
    for add in (False, True):
        rendered = ours_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add)
        assert rendered == theirs.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add
        )
    info = inspect_checkpoint(model_folder)
    eos = json.loads((export / "generation_config.json").read_bytes())["eos_token_id"]
    assert tuple(eos if isinstance(eos, list) else [eos]) == info.eos_token_ids
    assert inspect_checkpoint(export).eos_token_ids == info.eos_token_ids
    return delta


def _tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            names.update(fh.keys())
    return names
