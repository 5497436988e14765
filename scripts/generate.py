"""Sample text from a trained checkpoint, in one process, without a KV cache (for the small flavors).

From the repository root:

    python scripts/generate.py outputs/debug_model/checkpoint/step-60 --prompt "The Python" --max_new_tokens 40
    python scripts/generate.py hf_export --hf --flavor 8B --hf_assets_path Meta-Llama-3.1-8B --prompt "Hello"

The checkpoint is a DCP step folder (the model weights are read from it, whatever the sharding it was saved with)
or, with --hf, a Hugging Face folder (config.json + safetensors). Its vocabulary must be the tokenizer's
(--hf_assets_path, default the bundled one, as in training). --temperature 0 picks the most likely token at every
step (greedy); --top_k keeps only the k most likely tokens before sampling. Generation stops at the end-of-text
token. Prints the prompt followed by the generated text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Running `python scripts/generate.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan.components.checkpoint import complete_steps, read_full_model  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import CONFIG_FILE, is_hf_folder, load_hf  # noqa: E402
from torchtitan.components.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import llama3_flavors, model_args_for  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402


def load_model(checkpoint: Path, flavor: str, hf: bool, context_len: int, device: torch.device) -> Transformer:
    """The `flavor` model with the checkpoint's weights, in float32 on `device`, ready for `context_len` tokens."""
    if flavor not in llama3_flavors:
        raise UserError(f"--flavor: unknown flavor {flavor!r}; valid: {', '.join(llama3_flavors)}")
    max_seq_len = llama3_flavors[flavor].max_seq_len
    if context_len > max_seq_len:
        raise UserError(f"--max_new_tokens: the prompt and the new tokens ({context_len}) exceed the {max_seq_len} "
                        f"tokens that flavor {flavor} supports")
    if not checkpoint.exists():
        raise UserError(f"checkpoint {checkpoint} does not exist")
    if hf != is_hf_folder(checkpoint):
        raise UserError(f"checkpoint {checkpoint} is a Hugging Face folder: add --hf" if not hf else
                        f"--hf: {checkpoint} is not a Hugging Face model folder (config.json with model.safetensors "
                        f"or model.safetensors.index.json)")
    if hf:
        model_args = model_args_for(flavor, context_len, _hf_vocab_size(checkpoint))
        state_dict = load_hf(checkpoint, Llama3StateDictAdapter(model_args))
    else:
        steps = complete_steps(checkpoint)
        if steps:
            raise UserError(f"checkpoint {checkpoint} is a folder of checkpoints: pass one step folder, e.g. "
                            f"{checkpoint / f'step-{steps[-1]}'}")
        state_dict = read_full_model(checkpoint)
        embeddings = state_dict.get("tok_embeddings.weight")
        if embeddings is None:
            raise UserError(f"checkpoint {checkpoint} has no tok_embeddings.weight: it is not a Llama checkpoint")
        model_args = model_args_for(flavor, context_len, embeddings.shape[0])
        for name, shape in Llama3StateDictAdapter(model_args).expected_shapes().items():
            if name not in state_dict or state_dict[name].shape != shape:
                found = list(state_dict[name].shape) if name in state_dict else "nothing"
                raise UserError(f"checkpoint {checkpoint}: {name} is {found}, --flavor {flavor} expects "
                                f"{list(shape)}; choose the flavor it was trained with")
    with torch.device("meta"):
        model = Transformer(model_args)
    model.load_state_dict({name: tensor.to(device, torch.float32) for name, tensor in state_dict.items()},
                          strict=True, assign=True)
    model.init_buffers(device)
    return model.eval()


def _hf_vocab_size(folder: Path) -> int:
    path = folder / CONFIG_FILE
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} cannot be read or has no vocab_size: {err}") from err


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """The next token id from the last position's `logits` (vocab,)."""
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, -torch.inf)
    if temperature == 0:
        return int(torch.argmax(logits))
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probabilities.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None) -> list[int]:
    """The new token ids after `prompt_ids`: at most `max_new_tokens`, ending before the first `eos_id`."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        # The whole sequence each time: without a KV cache every step recomputes the prefix.
        logits = model(torch.tensor([ids], device=device))[0, -1]
        token = next_token(logits, temperature, top_k, generator)
        if token == eos_id:
            break
        ids.append(token)
    return ids[len(prompt_ids):]


def _check_vocab(tokenizer: Tokenizer, model: Transformer, assets: str) -> None:
    if tokenizer.vocab_size != model.args.vocab_size:
        raise UserError(f"--hf_assets_path: the tokenizer ({assets or 'bundled'}) has {tokenizer.vocab_size} ids, the "
                        f"checkpoint embeds {model.args.vocab_size}; pass the tokenizer the model was trained with")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/generate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="DCP step folder (or a Hugging Face folder with --hf)")
    parser.add_argument("--hf", action="store_true", help="the checkpoint is a Hugging Face folder")
    parser.add_argument("--flavor", default="debugmodel", help="model flavor it was trained as (default debugmodel)")
    parser.add_argument("--hf_assets_path", default="", help="tokenizer file or folder (default: the bundled one)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=50, help="tokens to generate at most (default 50)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--top_k", type=int, help="sample among the k most likely tokens only (default: all)")
    parser.add_argument("--seed", type=int, help="seed of the sampling (default: random)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise UserError(f"--max_new_tokens: {args.max_new_tokens} must be at least 1")
        if not args.temperature >= 0:
            raise UserError(f"--temperature: {args.temperature} must be 0 (greedy) or positive")
        if args.top_k is not None and args.top_k < 1:
            raise UserError(f"--top_k: {args.top_k} must be at least 1")
        tokenizer = build_tokenizer(args.hf_assets_path)
        prompt_ids = tokenizer.encode(args.prompt, add_bos=True, add_eos=False)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(args.checkpoint, args.flavor, args.hf, len(prompt_ids) + args.max_new_tokens, device)
        _check_vocab(tokenizer, model, args.hf_assets_path)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    new_ids = generate(model, prompt_ids, args.max_new_tokens, tokenizer.eos_id, args.temperature, args.top_k,
                       args.seed)
    # The prompt without its beginning-of-text token, which decodes to a marker rather than text.
    print(tokenizer.decode(prompt_ids[1:] + new_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
