"""``load_named_tensors`` refuses values that are not finite in the model's dtype, by
tensor and index, before copying anything."""

from __future__ import annotations

import pytest
import torch

from inference.engine.weights import load_named_tensors, parameter_shapes
from inference.errors import RequestValidationError


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)


@pytest.mark.parametrize(
    ("value", "dtype", "got"),
    [
        (float("nan"), torch.float32, "nan"),
        (float("inf"), torch.float32, "inf"),
        (float("-inf"), torch.bfloat16, "-inf"),
        (1e5, torch.float16, "100000.0"),  # finite in float32, inf once cast to float16
    ],
)
def test_non_finite_value_is_refused_by_name_and_index(
    value: float, dtype: torch.dtype, got: str
) -> None:
    target = model(dtype)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    poisoned = torch.zeros(2, 3)
    poisoned[1, 2] = value
    named = [("0.bias", torch.ones(3)), ("1.weight", poisoned), ("1.bias", torch.ones(2))]
    with pytest.raises(RequestValidationError) as info:
        load_named_tensors(target, named)
    name = str(dtype).removeprefix("torch.")
    assert str(info.value) == (
        f"1.weight[1, 2]: expected a finite value in {name} (the engine's dtype), got {got}"
    )
    for key, tensor in target.state_dict().items():  # the valid tensor before it too
        assert torch.equal(tensor, before[key]), key


def test_the_check_spans_slices_of_large_tensors() -> None:
    big = torch.nn.Linear(2100, 2048, bias=False)  # 4.3M elements: two check slices
    weights = torch.zeros(2048, 2100)
    weights[-1, -1] = float("nan")
    with pytest.raises(RequestValidationError, match=r"^weight\[2047, 2099\]: expected a finite"):
        load_named_tensors(big, [("weight", weights)])


def test_finite_tensors_load_and_the_errors_are_value_errors() -> None:
    target = model(torch.bfloat16)
    assert load_named_tensors(target, [("1.bias", torch.full((2,), 2.0))]) == 1
    assert target.state_dict()["1.bias"].tolist() == [2.0, 2.0]
    assert parameter_shapes(target) == {
        "0.weight": (3, 4),
        "0.bias": (3,),
        "1.weight": (2, 3),
        "1.bias": (2,),
    }
    assert issubclass(RequestValidationError, ValueError)
