import os

import pytest
import torch

# Keep CPU tests deterministic and light on a 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
