"""Checks the checkpoint tests share: two trainers' optimizer states, field by field."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_optimizer_state(trained: Any, fresh: Any) -> None:
    """``fresh``'s AdamW state equals ``trained``'s exactly (and is not empty)."""
    assert trained.worker.optimizer is not None and fresh.worker.optimizer is not None
    want_opt, got_opt = trained.worker.optimizer.state_dict(), fresh.worker.optimizer.state_dict()
    assert want_opt["param_groups"] == got_opt["param_groups"]
    assert want_opt["state"].keys() == got_opt["state"].keys() and want_opt["state"]
    for index, fields in want_opt["state"].items():
        assert fields.keys() == got_opt["state"][index].keys()
        for field, value in fields.items():
            assert torch.equal(value, got_opt["state"][index][field]), (index, field)
