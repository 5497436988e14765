import base64
import json
from pathlib import Path

import pytest

from torchtitan.components.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_model_tokenizer,
    build_tokenizer,
    llama3_special_tokens,
)
from torchtitan.config.job_config import Model
from torchtitan.errors import UserError

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.\n\nA second paragraph.",
    "Unicode: héllo wörld, 日本語のテキスト, Ελληνικά, emoji 🚀🔥 and combining e\u0301.",
    "   leading and trailing whitespace \t\t\n\n\r\n  ",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
    "numbers 1234567890 3.14159 -42 0x1F",
    "<|begin_of_text|> special-looking text <|eot_id|> <s> </s>",
]


@pytest.fixture(autouse=True)
def _private_tiktoken_cache(tmp_path, monkeypatch):
    # tiktoken copies every file it loads into a cache folder; keep the tests' copies out of /tmp.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return build_tokenizer("")


def write_tiktoken_file(path: Path, num_ranks: int) -> Path:
    """A syntactically valid BPE file: the 256 bytes, then distinct 3-byte tokens as fake merges."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [(i).to_bytes(3, "big") for i in range(num_ranks - 256)]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_bundled_round_trip(bundled, text):
    ids = bundled.encode(text, add_bos=False, add_eos=False)
    assert all(0 <= i < bundled.vocab_size for i in ids)
    assert bundled.decode(ids) == text


def test_bundled_layout(bundled):
    assert isinstance(bundled, TiktokenTokenizer)
    assert bundled.vocab_size == 2048 + 256
    assert bundled.bos_id == 2048
    assert bundled.eos_id == 2049
    assert bundled.decode([bundled.bos_id, bundled.eos_id]) == "<|begin_of_text|><|end_of_text|>"


def test_bundled_is_a_useful_bpe(bundled):
    text = "The function returns the value of the attribute."
    assert len(bundled.encode(text, add_bos=False, add_eos=False)) < len(text) / 2


def test_bos_eos_flags(bundled):
    plain = bundled.encode("some text", add_bos=False, add_eos=False)
    assert bundled.encode("some text", add_bos=True, add_eos=False) == [bundled.bos_id, *plain]
    assert bundled.encode("some text", add_bos=False, add_eos=True) == [*plain, bundled.eos_id]
    assert bundled.encode("some text", add_bos=True, add_eos=True) == [bundled.bos_id, *plain, bundled.eos_id]
    assert bundled.encode("", add_bos=True, add_eos=True) == [bundled.bos_id, bundled.eos_id]


def test_special_token_text_is_not_a_control_token(bundled):
    ids = bundled.encode("<|begin_of_text|><|end_of_text|><|eot_id|>", add_bos=False, add_eos=False)
    assert all(i < 2048 for i in ids)


def test_long_inputs_encode(bundled):
    for text in ["The cat sat. " * 80_000, " " * 100_000, "x" * 1_000_000, "\n" * 200_000 + "end"]:
        ids = bundled.encode(text, add_bos=False, add_eos=False)
        assert bundled.decode(ids) == text


def test_llama3_special_token_layout():
    special = llama3_special_tokens(128000)
    assert len(special) == 256
    assert sorted(special.values()) == list(range(128000, 128256))
    assert special["<|begin_of_text|>"] == 128000
    assert special["<|end_of_text|>"] == 128001
    assert special["<|reserved_special_token_0|>"] == 128002
    assert special["<|reserved_special_token_1|>"] == 128003
    assert special["<|finetune_right_pad_id|>"] == 128004
    assert special["<|step_id|>"] == 128005
    assert special["<|start_header_id|>"] == 128006
    assert special["<|end_header_id|>"] == 128007
    assert special["<|eom_id|>"] == 128008
    assert special["<|eot_id|>"] == 128009
    assert special["<|python_tag|>"] == 128010
    assert special["<|reserved_special_token_2|>"] == 128011
    assert special["<|reserved_special_token_246|>"] == 128255


def test_llama3_sized_file(tmp_path):
    tokenizer = build_tokenizer(str(write_tiktoken_file(tmp_path / "tokenizer.model", 128000)))
    assert tokenizer.vocab_size == 128256
    assert tokenizer.bos_id == 128000
    assert tokenizer.eos_id == 128001
    assert tokenizer.decode(tokenizer.encode("abc", add_bos=True, add_eos=True)) == (
        "<|begin_of_text|>abc<|end_of_text|>"
    )


def test_edited_file_is_reloaded(tmp_path):
    path = write_tiktoken_file(tmp_path / "tokenizer.model", 300)
    assert TiktokenTokenizer(path).vocab_size == 300 + 256
    write_tiktoken_file(path, 400)
    assert TiktokenTokenizer(path).vocab_size == 400 + 256


def test_folder_lookup(tmp_path):
    (tmp_path / "original").mkdir()
    write_tiktoken_file(tmp_path / "original" / "tokenizer.model", 300)
    assert build_tokenizer(str(tmp_path)).vocab_size == 300 + 256
    write_tiktoken_file(tmp_path / "tokenizer.model", 400)
    assert build_tokenizer(str(tmp_path)).vocab_size == 400 + 256


def _train_hf_tokenizer(folder: Path, with_config: bool) -> Path:
    from tokenizers import Tokenizer as HFBackend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 20, trainer)
    # A post-processor that adds BOS itself, as many released tokenizer.json files have.
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if with_config:
        config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("with_config", [True, False])
def test_hf_tokenizer(tmp_path, with_config):
    path = _train_hf_tokenizer(tmp_path / "hf", with_config)
    tokenizer = build_tokenizer(str(tmp_path / "hf"))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.bos_id == 1
    assert tokenizer.eos_id == 2
    assert tokenizer.vocab_size == 400
    for text in TEXTS:
        plain = tokenizer.encode(text, add_bos=False, add_eos=False)
        assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
        assert tokenizer.decode(plain) == text
        assert tokenizer.encode(text, add_bos=True, add_eos=True) == [1, *plain, 2]
    assert build_tokenizer(str(path)).encode("abc", add_bos=False, add_eos=False) == tokenizer.encode(
        "abc", add_bos=False, add_eos=False
    )


def test_hf_folder_prefers_tokenizer_json(tmp_path):
    _train_hf_tokenizer(tmp_path, with_config=True)
    write_tiktoken_file(tmp_path / "tokenizer.model", 300)
    assert isinstance(build_tokenizer(str(tmp_path)), HFTokenizer)


def test_hf_config_naming_unknown_token(tmp_path):
    _train_hf_tokenizer(tmp_path, with_config=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    with pytest.raises(UserError, match="<bos>"):
        build_tokenizer(str(tmp_path))


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(UserError, match=r"^model\.hf_assets_path") as excinfo:
        build_tokenizer(str(missing))
    assert str(missing) in str(excinfo.value)


def test_errors_name_the_option_that_gave_the_path(tmp_path):
    missing = tmp_path / "absent.model"
    with pytest.raises(UserError, match=r"^model\.tokenizer_path: .*absent\.model does not exist"):
        build_model_tokenizer(Model(tokenizer_path=str(missing)))
    with pytest.raises(UserError, match=r"^model\.hf_assets_path: .*absent\.model does not exist"):
        build_model_tokenizer(Model(hf_assets_path=str(missing)))
    corrupt = tmp_path / "tokenizer.model"
    corrupt.write_bytes(b"QQ== 0\nQg== 5\n")
    with pytest.raises(UserError, match=r"^model\.tokenizer_path: .*tokenizer\.model is not a valid tiktoken"):
        build_model_tokenizer(Model(tokenizer_path=str(corrupt), hf_assets_path=str(missing)))


def test_model_tokenizer_prefers_tokenizer_path(tmp_path):
    path = write_tiktoken_file(tmp_path / "tokenizer.model", 300)
    assert build_model_tokenizer(Model(tokenizer_path=str(path))).vocab_size == 300 + 256
    assert build_model_tokenizer(Model(hf_assets_path=str(path))).vocab_size == 300 + 256
    assert build_model_tokenizer(Model()).vocab_size == build_tokenizer("").vocab_size


def test_empty_folder(tmp_path):
    with pytest.raises(UserError, match=r"^model\.hf_assets_path") as excinfo:
        build_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(excinfo.value)
    assert "tokenizer.json" in str(excinfo.value)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.model", b"\x0a\x8f\x01not a tiktoken file\xff\xfe"),
        ("tokenizer.model", b"QQ== 0\nQg== 5\n"),
        ("tokenizer.model", b""),
        ("tokenizer.json", b"{not json"),
    ],
)
def test_corrupt_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"^model\.hf_assets_path") as excinfo:
        build_tokenizer(str(path))
    assert str(path) in str(excinfo.value)


def test_default_asset_is_small_and_bundled():
    assert DEFAULT_TOKENIZER_PATH.is_file()
    assert DEFAULT_TOKENIZER_PATH.stat().st_size < 64 * 1024
