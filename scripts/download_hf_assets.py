"""Download a model's tokenizer (and, to start from its weights, its safetensors) from the Hugging Face hub into the
folder the presets read.

From the repository root:

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer safetensors

Files go to `<local_dir>/<repository name>` (default `assets/hf/Llama-3.1-8B`, the `model.hf_assets_path` of
train_configs/llama3_8b.toml). With `safetensors`, train from the weights with `--checkpoint.initial_load_path
assets/hf/Llama-3.1-8B --checkpoint.initial_load_in_hf`. Meta's repositories are gated: accept the license on the
model's hub page, then pass `--hf_token` or set HF_TOKEN (or run `hf auth login`). A download that stopped resumes
where it stopped.
"""

import argparse
import sys
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

ASSETS = {
    # Every layout the trainer's tokenizer loader reads (torchtitan/components/tokenizer.py).
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "original/tokenizer.model"],
    # What checkpoint.initial_load_in_hf reads: the config and the weights, one file or sharded with an index.
    "safetensors": ["config.json", "*.safetensors", "model.safetensors.index.json"],
    "config": ["config.json", "generation_config.json"],
}


class DownloadError(Exception):
    """A download that cannot succeed as asked: the message says why and what to do."""


def download(repo_id: str, assets: list[str], local_dir: Path, token: str | None = None,
             revision: str | None = None) -> Path:
    """The files of `assets` of the hub repository `repo_id`, in `local_dir/<repository name>`; that folder."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise DownloadError(f"--repo_id {repo_id!r} is not a hub repository id; expected owner/name, e.g. "
                            f"meta-llama/Llama-3.1-8B")
    target = local_dir / repo_id.split("/")[1]
    patterns = [pattern for asset in assets for pattern in ASSETS[asset]]
    try:
        snapshot_download(repo_id, revision=revision, local_dir=target, allow_patterns=patterns, token=token)
    except GatedRepoError:
        raise DownloadError(f"{repo_id} is gated: accept its license on its hub page (https://huggingface.co/"
                            f"{repo_id}), then pass --hf_token or set HF_TOKEN (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise DownloadError(f"{repo_id}: no such repository on the hub, or this token may not see it (a private "
                            f"repository needs --hf_token)") from None
    except RevisionNotFoundError:
        raise DownloadError(f"{repo_id}: no revision {revision!r}") from None
    except LocalEntryNotFoundError as e:
        # What snapshot_download raises when the hub cannot be asked (unreachable, or an error) and nothing is cached.
        reason = e.__cause__ or e.__context__ or e
        raise DownloadError(f"{repo_id}: the hub could not list the repository's files ({type(reason).__name__}: "
                            f"{' '.join(str(reason).split())}); check the network, or HF_ENDPOINT") from None
    except HfHubHTTPError as e:
        raise DownloadError(f"{repo_id}: the hub answered {' '.join(str(e).split())}") from None
    found = sorted(str(p.relative_to(target)) for p in target.rglob("*")
                   if p.is_file() and ".cache" not in p.relative_to(target).parts)
    for asset in assets:
        if not any(Path(name).match(pattern) for name in found for pattern in ASSETS[asset]):
            raise DownloadError(f"{repo_id} has no {asset} files (looked for {', '.join(ASSETS[asset])})")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", required=True, help="hub repository, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument("--assets", nargs="+", choices=sorted(ASSETS), default=["tokenizer"],
                        help="what to download (default: tokenizer)")
    parser.add_argument("--local_dir", type=Path, default=Path("assets/hf"),
                        help="files go to LOCAL_DIR/<repository name> (default: assets/hf)")
    parser.add_argument("--hf_token", default=None, help="hub access token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    try:
        target = download(args.repo_id, args.assets, args.local_dir, args.hf_token, args.revision)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(args.assets)} of {args.repo_id} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
