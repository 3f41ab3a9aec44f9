"""Test-wide setup.

Without a GPU the Triton kernels run in Triton's interpreter. TRITON_INTERPRET must be set before
the module defining the kernels is imported, so it is set here, before anything imports flashsys.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

settings.register_profile("cpu", deadline=None, max_examples=25, derandomize=False)
# On a GPU every new shape may compile new kernel variants: shrinking a failure would run for many
# minutes, so failures are reported as found.
settings.register_profile("gpu", deadline=None, max_examples=60, phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("gpu" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session", autouse=True)
def _native_launcher_ready():
    """On a GPU, repeated eager attention calls take the native launcher once its extension is built (in the
    background on first use). Build it before any test, so that each test runs the path a user gets, not whichever
    one the build's timing picks."""
    if torch.cuda.is_available():
        from flashsys.ops.attention.replay import native

        native.wait()
    yield
