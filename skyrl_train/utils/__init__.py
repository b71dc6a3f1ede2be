"""Small shared utilities: CPU topology and parallel row filling (re-exported here),
crash-safe file writes (``durable``), the launch's logging (``logs``), starting or
joining Ray (``ray_session``) and metrics tracking (``tracking``)."""

from skyrl_train.utils.cpu_topology import permitted_cpu_cores, pool_workers
from skyrl_train.utils.parallel import fill_batch_rows

__all__ = ["fill_batch_rows", "permitted_cpu_cores", "pool_workers"]
