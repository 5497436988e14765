"""scripts/generate.py: loading DCP and Hugging Face checkpoints into one process, greedy and top-k sampling."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from scripts import generate
from torchtitan.components.checkpoint.hf_folder import save_hf
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

# The fixtures write checkpoints with DCP in one process, as the trainer's single-process tools do; DCP warns that
# it assumes so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PROMPT = "The Python language"
NEW_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # On a busy machine several OpenMP threads wait on each other far longer than this tiny model computes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("")


@pytest.fixture(scope="module")
def weights(tokenizer):
    args = model_args_for("tiny", seq_len=64, vocab_size=tokenizer.vocab_size)
    model = Transformer(args)
    model.init_weights(seed=3)
    return args, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory, weights):
    """A model-only checkpoint as the trainer writes one: DCP, keys `model.<parameter name>`."""
    folder = tmp_path_factory.mktemp("checkpoint") / "step-10"
    dcp.save({"model": weights[1]}, checkpoint_id=folder, no_dist=True)
    return folder


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, weights):
    folder = tmp_path_factory.mktemp("hf") / "export"
    save_hf(folder, weights[1], Llama3StateDictAdapter(weights[0]), torch.float32)
    return folder


def run(capsys, *argv):
    code = generate.main([*map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generated(capsys, *argv) -> tuple[int, str]:
    """The exit code and the generated text: what two runs are compared by (the logs on stderr carry times)."""
    code, out, _ = run(capsys, *argv)
    return code, out


def argmax_continuation(weights, tokenizer, prompt: str, steps: int) -> str:
    """Greedy decoding written out: the full model on the whole sequence, the most likely next token, repeat."""
    args, state_dict = weights
    model = Transformer(model_args_for("tiny", seq_len=64, vocab_size=args.vocab_size))
    model.load_state_dict(state_dict)
    model.init_buffers(torch.device("cpu"))
    ids = tokenizer.encode(prompt, add_bos=True, add_eos=False)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            ids.append(token)
    return tokenizer.decode(ids[1:])


def test_greedy_is_deterministic_and_equals_an_argmax_loop(capsys, dcp_checkpoint, weights, tokenizer):
    argv = [dcp_checkpoint, "--flavor", "tiny", "--prompt", PROMPT, "--max_new_tokens", NEW_TOKENS,
            "--temperature", 0]
    first = generated(capsys, *argv, "--seed", 1)
    second = generated(capsys, *argv, "--seed", 2)
    assert first == second
    code, out = first
    assert code == 0
    assert out == argmax_continuation(weights, tokenizer, PROMPT, NEW_TOKENS) + "\n"
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 1


def test_top_k_1_equals_greedy_at_any_temperature(capsys, dcp_checkpoint):
    argv = [dcp_checkpoint, "--flavor", "tiny", "--prompt", PROMPT, "--max_new_tokens", NEW_TOKENS]
    greedy = generated(capsys, *argv, "--temperature", 0)
    assert generated(capsys, *argv, "--temperature", 1.5, "--top_k", 1, "--seed", 7) == greedy


def test_sampling_is_reproducible_with_a_seed(capsys, dcp_checkpoint):
    argv = [dcp_checkpoint, "--flavor", "tiny", "--prompt", PROMPT, "--max_new_tokens", NEW_TOKENS,
            "--temperature", 1.0, "--top_k", 50, "--seed", 5]
    first = generated(capsys, *argv)
    assert first[0] == 0 and first == generated(capsys, *argv)


def test_hugging_face_folder_generates_what_the_dcp_checkpoint_does(capsys, dcp_checkpoint, hf_checkpoint):
    common = ["--flavor", "tiny", "--prompt", PROMPT, "--max_new_tokens", NEW_TOKENS, "--temperature", 0]
    from_hf = generated(capsys, hf_checkpoint, "--hf", *common)
    assert from_hf[0] == 0 and from_hf == generated(capsys, dcp_checkpoint, *common)


class _Scripted(nn.Module):
    """Predicts a fixed sequence of next tokens, whatever the input."""

    def __init__(self, script: list[int], vocab_size: int):
        super().__init__()
        self.next_tokens = iter(script)
        self.vocab_size = vocab_size
        # generate() puts its inputs on the device of the model's parameters.
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(1, tokens.shape[1], self.vocab_size)
        logits[0, -1, next(self.next_tokens)] = 1.0
        return logits


def test_generation_stops_before_the_end_of_text_token():
    model = _Scripted([5, 7, 2, 9], vocab_size=10)
    assert generate.generate(model, [1], max_new_tokens=10, eos_id=2) == [5, 7]
    assert generate.generate(_Scripted([5, 7, 2], vocab_size=10), [1], max_new_tokens=1, eos_id=2) == [5]


def test_top_k_masks_all_but_the_k_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    generator = torch.Generator().manual_seed(0)
    drawn = {generate.next_token(logits, 10.0, 2, generator) for _ in range(200)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("parent", "is a folder of checkpoints: pass one step folder"),
    ("flavor", "--flavor debugmodel expects"),
    ("temperature", "--temperature: -1.0 must be 0"),
    ("top_k", "--top_k: 0 must be at least 1"),
    ("not_hf", "--hf: "),
    ("hf_without_flag", "is a Hugging Face folder: add --hf"),
    ("tokenizer", "no_tokenizer does not exist"),
])
def test_errors(capsys, tmp_path, dcp_checkpoint, hf_checkpoint, case, expected):
    argv = {
        "missing": [tmp_path / "nowhere", "--flavor", "tiny"],
        "parent": [dcp_checkpoint.parent, "--flavor", "tiny"],
        "flavor": [dcp_checkpoint, "--flavor", "debugmodel"],
        "temperature": [dcp_checkpoint, "--flavor", "tiny", "--temperature", -1],
        "top_k": [dcp_checkpoint, "--flavor", "tiny", "--top_k", 0],
        "not_hf": [dcp_checkpoint, "--flavor", "tiny", "--hf"],
        "hf_without_flag": [hf_checkpoint, "--flavor", "tiny"],
        "tokenizer": [dcp_checkpoint, "--flavor", "tiny", "--hf_assets_path", tmp_path / "no_tokenizer"],
    }[case]
    code, out, err = run(capsys, *argv, "--prompt", PROMPT)
    assert code == 2 and out == ""
    # Progress may be logged to stderr before the error: the error itself is one line of its own.
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and expected in error_lines[0], err


def test_tokenizer_must_match_the_checkpoint_vocabulary(capsys, tmp_path, tokenizer):
    model = Transformer(model_args_for("tiny", seq_len=64, vocab_size=tokenizer.vocab_size + 64))
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "step-1", no_dist=True)
    code, _, err = run(capsys, tmp_path / "step-1", "--flavor", "tiny", "--prompt", PROMPT)
    assert code == 2
    assert f"has {tokenizer.vocab_size} ids, the checkpoint embeds {tokenizer.vocab_size + 64}" in err, err
