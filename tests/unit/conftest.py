import types

import pytest
import torch
from torch.distributed.tensor.debug import _clear_sharding_prop_cache


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # Unit-test tensors are tiny: on a shared CPU, intra-op threads only add contention and make the tests slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_sharding_propagations_of_another_world():
    # DTensor's sharding-propagation caches return an earlier op's output spec, its mesh object included, for input
    # meshes that compare equal, and DeviceMesh equality ignores the rank and the process group: a test playing rank
    # 1 of a fake world after one that played rank 0 would get rank 0's mesh (tests/unit/forked_ranks.py, where
    # forked ranks inherit the entries, says more).
    yield
    _clear_sharding_prop_cache()


@pytest.fixture
def hub_client(tmp_path, monkeypatch):
    """Points the hub client at HF_ENDPOINT (set per test) with a fresh cache and no waits in the libraries."""
    import datasets.config
    import huggingface_hub.constants
    from huggingface_hub import HfFileSystem
    from huggingface_hub.utils import _http

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    for name in ("STREAMING_READ_MAX_RETRIES", "STREAMING_OPEN_MAX_RETRIES"):
        monkeypatch.setattr(datasets.config, name, 1)
    for name in ("STREAMING_READ_RETRY_INTERVAL", "STREAMING_OPEN_RETRY_INTERVAL",
                 "STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL", "STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL"):
        monkeypatch.setattr(datasets.config, name, 0)

    def point_at(url: str) -> None:
        # What HF_ENDPOINT sets when these libraries are imported (they are, by earlier tests, before it could be).
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
        monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", url + "/datasets/{repo_id}/resolve/{revision}/{path}")
        HfFileSystem.clear_instance_cache()

    yield point_at
    HfFileSystem.clear_instance_cache()
