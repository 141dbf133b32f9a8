import os

import pytest
import torch


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
