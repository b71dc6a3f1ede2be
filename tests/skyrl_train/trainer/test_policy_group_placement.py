"""Which placement-group bundle each trainer rank takes (``trainer.placement.strategy``)."""

from __future__ import annotations

from skyrl_train.trainer.policy_group import rank_bundles


def test_ranks_of_a_node_are_consecutive_and_the_drivers_node_comes_first() -> None:
    # Ray may interleave nodes over bundles (SPREAD); a tensor group of ranks 0-1 would
    # then span two nodes.
    nodes = {0: "b", 1: "a", 2: "b", 3: "a", 4: "c", 5: "c"}
    assert rank_bundles(nodes, first_node="a") == [1, 3, 0, 2, 4, 5]
    assert rank_bundles(nodes, first_node="c") == [4, 5, 0, 2, 1, 3]


def test_without_a_bundle_on_the_drivers_node_the_order_is_ray_s() -> None:
    assert rank_bundles({0: "b", 1: "c"}, first_node="a") == [0, 1]
    assert rank_bundles({}, first_node="a") == []
