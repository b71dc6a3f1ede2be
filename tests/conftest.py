"""Suite-wide settings: one thread per process, as in CI.

Torch with 2 threads on a shared 2-core machine ran 35x slower than with 1.
"""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The built-in model's checkpoint folder (keyed by config and seed) goes to a temp
# cache, not the user's ~/.cache; launches write it once and reuse it.
os.environ.setdefault("SKYRL_R3_CACHE", os.path.join(tempfile.gettempdir(), "skyrl_r3_tests"))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
