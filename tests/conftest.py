import os
import random
import sys
from pathlib import Path

import pytest
import torch

import helpers

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


@pytest.fixture(autouse=True)
def poisoned_allocations(request):
    """GPU tests allocate poisoned memory: every uninitialized allocation (``torch.empty`` and the
    like, the ops' outputs and workspaces among them) is filled with NaN (floating point, FP8
    included) or the dtype's largest value (integers), so a tile a kernel leaves unwritten, or
    a read of memory nothing wrote, fails the comparison instead of passing on a stale zero.
    This is torch's ``fill_uninitialized_memory`` under ``use_deterministic_algorithms`` (warn
    only: torch's nondeterministic ops still run). Not for timing tests (the fills are extra
    launches) nor for ``unpoisoned`` ones (they test the flag itself)."""
    if "gpu" not in request.keywords or "timing" in request.keywords or "unpoisoned" in request.keywords:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


#: CODA_TEST_SEED=N reruns every test on the seed a failure reported
_SEED = os.environ.get("CODA_TEST_SEED")


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Every test draws fresh random inputs: torch's and Python's global generators, and the
    tests' own (``helpers.generator``), are seeded from the OS before each test
    (``CODA_TEST_SEED`` pins it), and a failure's report names the seed to rerun it with."""
    seed = int(_SEED) if _SEED is not None else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    helpers.set_test_seed(seed)  # the tests' own generators (helpers.generator) derive from it
    request.node.coda_seed = seed
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "coda_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"rerun with CODA_TEST_SEED={seed}"))
    return report
