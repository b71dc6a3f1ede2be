"""Tiny random checkpoints of every family, written once per test session.

Writing one takes ~50 ms after the first (transformers import and tokenizer training
dominate), so every test that needs a real folder of some family shares these.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.models.families import FAMILIES
from inference.models.tiny_checkpoint import write_tiny_checkpoint

FAMILY_NAMES = tuple(FAMILIES)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family name -> checkpoint folder (``TinySizes()``, seed 0). Read-only: copy first."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: write_tiny_checkpoint(name, root / name, seed=0) for name in FAMILY_NAMES}
