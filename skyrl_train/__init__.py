"""Training side of the R3 pipeline: generator, preprocessing, trainer and workers.

Only the per-token traces are re-exported here; importing them pulls in numpy alone.
"""

from skyrl_train.generators.traces import RoutedExpertTrace, TokenMetadataTrace

__all__ = ["RoutedExpertTrace", "TokenMetadataTrace"]
