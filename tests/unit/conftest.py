import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # Unit-test tensors are tiny: on a shared CPU, intra-op threads only add contention and make the tests slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
