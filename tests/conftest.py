import os
import sys
from pathlib import Path

import pytest
import torch

# The repository's top-level kernels/ folder is installed as coda_cute.kernels, but with the root on
# sys.path (`python -m pytest` run from it) it is importable as plain `kernels` and shadows Hugging
# Face's `kernels` distribution, which transformers >= 5.25 depends on and imports. Keep the root off
# this process's path and, through PYTHONSAFEPATH, off the paths of the processes the tests start
# (torchrun ranks, compile-cache probes).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"


def pytest_collection_modifyitems(config, items):
    # Timings are meaningless while other xdist workers share the GPU.
    shared = "PYTEST_XDIST_WORKER" in os.environ
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    busy = pytest.mark.skip(reason="timing test: run without pytest-xdist's -n (workers share the GPU)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif "timing" in item.keywords and shared:
            item.add_marker(busy)
