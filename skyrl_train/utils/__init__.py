"""Small shared utilities: CPU topology, parallel row filling, metrics tracking."""

from skyrl_train.utils.cpu_topology import permitted_cpu_cores, pool_workers
from skyrl_train.utils.parallel import fill_batch_rows

__all__ = ["fill_batch_rows", "permitted_cpu_cores", "pool_workers"]
