"""scripts/download_hf_assets.py against a local stand-in for the hub (tests/unit/hub_server.py): the files of each
asset land where the presets read them, and what cannot work (a gated repository, an unreachable hub, a repository
without the asset) is one error line."""

import re
import shutil
import socket

import pytest

from scripts import download_hf_assets
from tests.unit.hub_server import HubServer
from torchtitan.components.checkpoint.hf_folder import is_hf_folder
from torchtitan.components.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer


@pytest.fixture
def model_repository(tmp_path):
    root = tmp_path / "repo"
    (root / "original").mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER_PATH, root / "original" / "tokenizer.model")
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "README.md").write_text("not an asset")
    return root


def test_tokenizer_lands_where_the_trainer_reads_it(model_repository, tmp_path, hub_client, capsys):
    with HubServer(model_repository) as hub:
        hub_client(hub.url)
        assert download_hf_assets.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--local_dir",
                                        str(tmp_path / "assets")]) == 0
    target = tmp_path / "assets" / "Llama-3.1-8B"
    assert capsys.readouterr().out == f"wrote tokenizer of meta-llama/Llama-3.1-8B to {target}\n"
    assert (target / "original" / "tokenizer.model").is_file()
    assert not (target / "model.safetensors").exists() and not (target / "README.md").exists()
    assert build_tokenizer(str(target)).vocab_size == build_tokenizer("").vocab_size


def test_safetensors_give_a_folder_initial_load_in_hf_reads(model_repository, tmp_path, hub_client):
    with HubServer(model_repository) as hub:
        hub_client(hub.url)
        target = download_hf_assets.download("org/model", ["tokenizer", "safetensors"], tmp_path / "assets")
    assert is_hf_folder(target) and (target / "original" / "tokenizer.model").is_file()


@pytest.mark.parametrize("case, pattern", [
    ("gated", r"org/model is gated: accept its license .*--hf_token or set HF_TOKEN"),
    ("no tokenizer", r"org/model has no tokenizer files \(looked for tokenizer.json"),
    ("unreachable", r"org/model: the hub could not list the repository's files \(ConnectError: .*\); check the "
                    r"network, or HF_ENDPOINT"),
    ("bad id", r"--repo_id 'org' is not a hub repository id"),
])
def test_what_cannot_work_is_one_error_line(case, pattern, model_repository, tmp_path, hub_client, capsys):
    if case == "no tokenizer":
        shutil.rmtree(model_repository / "original")
    repo_id = "org" if case == "bad id" else "org/model"
    argv = ["--repo_id", repo_id, "--local_dir", str(tmp_path / "assets")]
    if case == "unreachable":
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            hub_client(f"http://127.0.0.1:{closed.getsockname()[1]}")
        code = download_hf_assets.main(argv)
    else:
        with HubServer(model_repository, gated=case == "gated") as hub:
            hub_client(hub.url)
            code = download_hf_assets.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    # Beside the hub client's progress bar (on stderr), one error line and no traceback.
    (line,) = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith("error: ") and re.search(pattern, line) and "Traceback" not in err, err
