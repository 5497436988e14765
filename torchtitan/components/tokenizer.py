"""Tokenizers: Llama 3's tiktoken BPE files and Hugging Face `tokenizer.json` files behind one interface."""

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from torchtitan.config.job_config import Model
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "tokenizer.model"

# Llama 3's pre-tokenization regex (the cl100k one): text is cut into these pieces before BPE runs.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# tiktoken panics or turns quadratic on huge inputs and on very long runs of (non-)whitespace, so text
# is encoded in windows of at most this many characters, with long runs cut at this length.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{_MAX_RUN_CHARS},}}|(?<!\S)\S{{{_MAX_RUN_CHARS},}}")

# The option named in errors: model.hf_assets_path, or model.tokenizer_path when that is what gave the path.
_OPTION = "model.hf_assets_path"
_KNOWN_BOS = (BOS_TOKEN, "<s>", "<|endoftext|>")
_KNOWN_EOS = (EOS_TOKEN, "</s>", "<|endoftext|>")


class Tokenizer(ABC):
    """Text <-> token ids, with the ids of the beginning- and end-of-sequence tokens."""

    # The file it was loaded from and its sha256 (set by build_tokenizer): token shards record them, so that the
    # trainer can refuse shards made with another tokenizer.
    file: str = ""
    checksum: str = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model must embed: every id this tokenizer can produce is below it."""

    @property
    @abstractmethod
    def bos_id(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Encode `text`, treating any special-token strings in it as plain text."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode(self, text: str, *, add_bos: bool, add_eos: bool) -> list[int]:
        ids = self._encode_text(text)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids


def llama3_special_tokens(num_base_tokens: int) -> dict[str, int]:
    """Llama 3's 256 special tokens and their ids, which follow the `num_base_tokens` BPE ranks."""
    named = [
        BOS_TOKEN,
        EOS_TOKEN,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    # Reserved numbering continues after the two reserved tokens named above, as Meta's files do.
    reserved = [
        f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_NUM_SPECIAL_TOKENS - len(named))
    ]
    return {token: num_base_tokens + i for i, token in enumerate(named + reserved)}


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file in the format of Llama 3's `tokenizer.model`, with Llama 3's special tokens."""

    def __init__(self, path: str | Path, option: str = _OPTION):
        path = str(path)
        try:
            # tiktoken caches file contents keyed by path alone; the content hash makes it notice edits.
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            ranks = load_tiktoken_bpe(path, expected_hash=digest)
        except (OSError, ValueError) as e:
            raise UserError(
                f"{option}: cannot read {path} as a tiktoken BPE file (Llama 3 tokenizer.model format, "
                f"one 'base64-token rank' pair per line): {e}"
            ) from e
        if not ranks or set(ranks.values()) != set(range(len(ranks))):
            raise UserError(
                f"{option}: {path} is not a valid tiktoken BPE file: expected ranks 0..N-1, each once, "
                f"in 'base64-token rank' lines"
            )
        self._special = llama3_special_tokens(len(ranks))
        self._encoding = tiktoken.Encoding(
            name=Path(path).name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self._special,
        )
        self._vocab_size = len(ranks) + len(self._special)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._special[BOS_TOKEN]

    @property
    def eos_id(self) -> int:
        return self._special[EOS_TOKEN]

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _pieces_for_tiktoken(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


def _pieces_for_tiktoken(text: str) -> Iterator[str]:
    """Cut `text` into pieces tiktoken can encode: bounded length, no overly long (non-)space run."""
    for window_start in range(0, len(text), _MAX_ENCODE_CHARS):
        window = text[window_start : window_start + _MAX_ENCODE_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(window):
            for cut in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                yield window[start:cut]
                start = cut
        yield window[start:]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`; BOS/EOS come from a `tokenizer_config.json` beside it if any."""

    def __init__(self, path: str | Path, option: str = _OPTION):
        from tokenizers import Tokenizer as _HFBackend

        path = Path(path)
        try:
            self._tokenizer = _HFBackend.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for unreadable files
            raise UserError(f"{option}: cannot read {path} as a Hugging Face tokenizer.json: {e}") from e
        # Special-token strings inside training text must stay text, like with the tiktoken tokenizer.
        self._tokenizer.encode_special_tokens = True
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        config = _read_tokenizer_config(path.parent / "tokenizer_config.json", option)
        self._bos_id = _resolve_special(vocab, config.get("bos_token"), _KNOWN_BOS, "bos_token", path, option)
        self._eos_id = _resolve_special(vocab, config.get("eos_token"), _KNOWN_EOS, "eos_token", path, option)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def _encode_text(self, text: str) -> list[int]:
        # The tokenizer.json's own post-processor would add BOS/EOS a second time.
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _read_tokenizer_config(path: Path, option: str) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{option}: cannot read {path} as JSON: {e}") from e
    if not isinstance(config, dict):
        raise UserError(f"{option}: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def _resolve_special(
    vocab: dict[str, int], configured: object, known: tuple[str, ...], key: str, path: Path, option: str
) -> int:
    # Older configs store special tokens as serialized AddedToken objects rather than plain strings.
    if isinstance(configured, dict):
        configured = configured.get("content")
    if isinstance(configured, str):
        if configured not in vocab:
            raise UserError(
                f"{option}: tokenizer_config.json beside {path} sets {key}={configured!r}, "
                f"which is not in the tokenizer's vocabulary"
            )
        return vocab[configured]
    for token in known:
        if token in vocab:
            return vocab[token]
    raise UserError(
        f"{option}: cannot tell the {key} of {path}: no tokenizer_config.json beside it sets {key}, "
        f"and none of {', '.join(known)} is in its vocabulary"
    )


def build_tokenizer(path: str, option: str = _OPTION) -> Tokenizer:
    """Load the tokenizer at `path`, the value of `option` (named in errors).

    `path` is a tiktoken BPE file, a `tokenizer.json`, or a folder holding `tokenizer.json` (preferred),
    `tokenizer.model` or `original/tokenizer.model`; empty means the small bundled tokenizer.
    """
    file = _locate(path, option)
    tokenizer: Tokenizer
    if file.suffix == ".json":
        tokenizer = HFTokenizer(file, option)
        kind = "Hugging Face"
    else:
        tokenizer = TiktokenTokenizer(file, option)
        kind = "tiktoken"
    tokenizer.file = str(file)
    tokenizer.checksum = hashlib.sha256(file.read_bytes()).hexdigest()
    logger.info(f"Loaded {kind} tokenizer from {file} (vocab size {tokenizer.vocab_size})")
    return tokenizer


def build_model_tokenizer(model: Model) -> Tokenizer:
    """The tokenizer of the [model] options: model.tokenizer_path when set, else model.hf_assets_path; errors name
    the option that gave the path."""
    if model.tokenizer_path:
        return build_tokenizer(model.tokenizer_path, option="model.tokenizer_path")
    return build_tokenizer(model.hf_assets_path, option="model.hf_assets_path")


def _locate(path: str, option: str) -> Path:
    if not path:
        return DEFAULT_TOKENIZER_PATH
    expected = (
        "a tokenizer.json, a tiktoken tokenizer.model, or a folder holding tokenizer.json, tokenizer.model "
        "or original/tokenizer.model (or empty for the bundled tokenizer)"
    )
    given = Path(path).expanduser()
    if given.is_dir():
        for candidate in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
            if (given / candidate).is_file():
                return given / candidate
        raise UserError(f"{option}: folder {path} holds no tokenizer; expected {expected}")
    if not given.is_file():
        repo = f"meta-llama/{given.name}" if given.name.startswith("Llama-") else "OWNER/NAME"
        raise UserError(f"{option}: {path} does not exist; expected {expected}. A model's tokenizer on the Hugging "
                        f"Face hub: python scripts/download_hf_assets.py --repo_id {repo} --assets tokenizer (it "
                        f"writes assets/hf/{repo.split('/')[1]})")
    return given
