"""Conversion between our Llama 3.1 state dicts and Hugging Face `LlamaForCausalLM` checkpoints.

Our model rotates consecutive pairs of each query/key head (Meta's layout); Hugging Face's rotates dimension `i`
with dimension `i + head_dim / 2` ("rotate half"). The two compute the same attention once the rows of `wq` and
`wk` are permuted within each head: Meta row `2j` becomes HF row `j`, Meta row `2j + 1` becomes HF row
`head_dim / 2 + j`. Every other weight is only renamed.

An HF folder holds `config.json` and either `model.safetensors` or shards listed in `model.safetensors.index.json`.
"""

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.logging import logger

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Older HF exports store the RoPE frequencies as a buffer; they are recomputed from the config.
_HF_IGNORED_SUFFIX = "rotary_emb.inv_freq"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _meta_to_hf_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _hf_to_meta_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(suffix: str, model_args: TransformerModelArgs) -> int | None:
    """The number of heads whose rows must be permuted for a layer weight, or None if it is only renamed."""
    if suffix == "attention.wq.weight":
        return model_args.n_heads
    if suffix == "attention.wk.weight":
        return model_args.kv_heads
    return None


def hf_name(name: str) -> str:
    """The `LlamaForCausalLM` name of one of our parameters."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _OUR_LAYER.match(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise UserError(f"state dict entry {name!r} is not a Llama 3 parameter; expected names like "
                        f"{', '.join(list(_TOP_LEVEL_NAMES) + ['layers.N.' + s for s in _LAYER_NAMES])}")
    layer, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"


def to_hf(state_dict: dict[str, torch.Tensor], model_args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """Our parameter names and layout -> `LlamaForCausalLM`'s."""
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        target = hf_name(name)
        heads = _rope_heads(name.split(".", 2)[-1], model_args)
        hf_state_dict[target] = tensor if heads is None else _meta_to_hf_rows(tensor, heads)
    return hf_state_dict


def from_hf(hf_state_dict: dict[str, torch.Tensor], model_args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM`'s parameter names and layout -> ours."""
    top_level = {hf: ours for ours, hf in _TOP_LEVEL_NAMES.items()}
    layer_names = {hf: ours for ours, hf in _LAYER_NAMES.items()}
    state_dict = {}
    for hf_name, tensor in hf_state_dict.items():
        if hf_name.endswith(_HF_IGNORED_SUFFIX):
            continue
        if hf_name in top_level:
            state_dict[top_level[hf_name]] = tensor
            continue
        match = _HF_LAYER.match(hf_name)
        if match is None or match.group(2) not in layer_names:
            raise UserError(f"Hugging Face tensor {hf_name!r} is not a LlamaForCausalLM parameter; expected "
                            f"names like {', '.join(list(top_level) + ['model.layers.N.' + s for s in layer_names])}")
        layer, hf_suffix = match.groups()
        suffix = layer_names[hf_suffix]
        heads = _rope_heads(suffix, model_args)
        state_dict[f"layers.{layer}.{suffix}"] = tensor if heads is None else _hf_to_meta_rows(tensor, heads)
    return state_dict


def hf_config(model_args: TransformerModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of a `LlamaForCausalLM` with our model's shapes."""
    rope_scaling = None
    if model_args.use_scaled_rope:
        # The constants of model.scale_rope_frequencies, i.e. Llama 3.1's published values.
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model_args.dim,
        "intermediate_size": model_args.ffn_hidden_dim,
        "num_hidden_layers": model_args.n_layers,
        "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.kv_heads,
        "head_dim": model_args.head_dim,
        "vocab_size": model_args.vocab_size,
        "max_position_embeddings": model_args.max_seq_len,
        "rms_norm_eps": model_args.norm_eps,
        "rope_theta": model_args.rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def expected_shapes(model_args: TransformerModelArgs) -> dict[str, torch.Size]:
    """Our parameter names and shapes for `model_args` (computed on the meta device, without memory)."""
    with torch.device("meta"):
        model = Transformer(model_args)
    return {name: param.shape for name, param in model.named_parameters()}


def _shards(hf_state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in hf_state_dict.items():
        tensor_bytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + tensor_bytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor_bytes
    return shards


def save_hf(folder: str | os.PathLike, state_dict: dict[str, torch.Tensor], model_args: TransformerModelArgs,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write our full (unsharded) `state_dict` as an HF folder that `LlamaForCausalLM.from_pretrained` reads.

    The files are written into `<folder>.incomplete`, which is renamed to `folder` once everything is on disk, so a
    crash never leaves a `folder` that looks complete. `folder` must not exist yet.
    """
    folder = Path(folder)
    if folder.exists():
        raise UserError(f"Hugging Face output folder {folder} already exists; remove it or choose another")
    staging = folder.with_name(folder.name + ".incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    hf_state_dict = {name: tensor.detach().to("cpu", dtype).contiguous()
                     for name, tensor in to_hf(state_dict, model_args).items()}
    shards = _shards(hf_state_dict, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], staging / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, staging / filename, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, filename))
        total_size = sum(t.numel() * t.element_size() for t in hf_state_dict.values())
        index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config(model_args, dtype), indent=2) + "\n")
    os.rename(staging, folder)


def is_hf_folder(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() and ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file())


# What transformers' LlamaConfig assumes for an entry that config.json leaves out.
_HF_DEFAULT_ROPE_THETA = 10000.0
_HF_DEFAULT_RMS_NORM_EPS = 1e-6
_LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _same(saved: object, expected: float) -> bool:
    # JSON may hold a float32 value printed in full (9.999999747378752e-06 for 1e-5): equal up to that rounding.
    return isinstance(saved, (int, float)) and not isinstance(saved, bool) and \
        math.isclose(saved, expected, rel_tol=1e-6)


def _hf_rope(config: dict) -> tuple[object, dict | None]:
    """rope_theta (None if absent) and the RoPE scaling entry of an HF config in either layout: transformers 5's
    `rope_parameters` (theta inside, `rope_type` "default" when unscaled) or the earlier top-level `rope_theta` and
    `rope_scaling`."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict):
        theta = parameters.get("rope_theta", config.get("rope_theta"))
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    else:
        theta = config.get("rope_theta")
        scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _check_config(folder: Path, model_args: TransformerModelArgs) -> None:
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"Hugging Face config {config_path} cannot be read: {err}") from err
    expected = hf_config(model_args)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size"):
        # HF omits num_key_value_heads when it equals num_attention_heads.
        saved = config.get(field, config.get("num_attention_heads") if field == "num_key_value_heads" else None)
        if saved != expected[field]:
            raise UserError(f"Hugging Face config {config_path}: {field} is {saved}, but the model (flavor with "
                            f"vocab_size {model_args.vocab_size}) needs {expected[field]}; choose the matching "
                            f"model.flavor (and [model] shape options)")
    # The shapes match whatever these are, so a mismatch would load silently and give other logits.
    # An absent entry means transformers' default, which is what transformers would compute with.
    theta, scaling = _hf_rope(config)
    absent = " (absent: transformers' default)"
    if not _same(_HF_DEFAULT_ROPE_THETA if theta is None else theta, model_args.rope_theta):
        shown = f"{_HF_DEFAULT_ROPE_THETA}{absent}" if theta is None else theta
        raise UserError(f"Hugging Face config {config_path}: rope_theta is {shown}, but the model uses "
                        f"{model_args.rope_theta:g}; the weights were trained with other rotary embeddings than "
                        f"this model.flavor computes, choose the matching flavor (or set model.rope_theta)")
    eps = config.get("rms_norm_eps")
    if not _same(_HF_DEFAULT_RMS_NORM_EPS if eps is None else eps, model_args.norm_eps):
        shown = f"{_HF_DEFAULT_RMS_NORM_EPS}{absent}" if eps is None else eps
        raise UserError(f"Hugging Face config {config_path}: rms_norm_eps is {shown}, but the model uses "
                        f"{model_args.norm_eps:g}; choose the matching model.flavor")
    _check_rope_scaling(config_path, scaling, expected["rope_scaling"])


def _check_rope_scaling(config_path: Path, scaling: object, expected: dict | None) -> None:
    """The model scales RoPE as Llama 3.1 (`expected` holds its constants) or not at all (`expected` is None)."""
    if expected is None:
        if scaling is not None:
            raise UserError(f"Hugging Face config {config_path}: rope_scaling is {scaling}, but the model does not "
                            f"scale RoPE; choose a flavor with Llama 3.1 RoPE scaling")
        return
    described = "Llama 3.1 RoPE scaling with " + ", ".join(f"{key} {expected[key]:g}" for key in _LLAMA3_ROPE_FIELDS)
    if not isinstance(scaling, dict):
        raise UserError(f"Hugging Face config {config_path}: it has no rope_scaling, but the model uses "
                        f"{described}; these weights are for unscaled RoPE, choose the matching model.flavor")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != expected["rope_type"]:
        raise UserError(f"Hugging Face config {config_path}: rope_scaling's rope_type is {rope_type!r}, but the "
                        f"model uses rope_type 'llama3' ({described}); other scalings are not supported")
    for key in _LLAMA3_ROPE_FIELDS:
        if not _same(scaling.get(key), expected[key]):
            raise UserError(f"Hugging Face config {config_path}: rope_scaling's {key} is {scaling.get(key)}, but "
                            f"the model uses {described}; other values are not supported")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as err:
            raise UserError(f"Hugging Face index {index_path} cannot be read (it needs a weight_map): "
                            f"{err}") from err
        files = sorted(set(weight_map.values()))
    else:
        files = [SINGLE_FILE]
    tensors = {}
    for number, filename in enumerate(files, start=1):
        path = folder / filename
        if len(files) > 1:
            size = f" ({path.stat().st_size / 2**30:.2f} GiB)" if path.is_file() else ""
            logger.info(f"Reading Hugging Face weights {number}/{len(files)}: {filename}{size}")
        try:
            tensors.update(load_file(path))
        except (OSError, SafetensorError) as err:
            raise UserError(f"Hugging Face weights file {path} cannot be read: {err}") from err
    return tensors


def load_hf(folder: str | os.PathLike, model_args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """Read an HF Llama folder into our full state dict (names, layout; dtype as stored), checking every shape."""
    folder = Path(folder)
    if not is_hf_folder(folder):
        raise UserError(f"{folder} is not a Hugging Face model folder: it needs {CONFIG_FILE} and {SINGLE_FILE} "
                        f"or {INDEX_FILE}")
    _check_config(folder, model_args)
    state_dict = from_hf(_read_tensors(folder), model_args)
    shapes = expected_shapes(model_args)
    missing = [name for name in shapes if name not in state_dict]
    if missing:
        raise UserError(f"Hugging Face folder {folder} lacks {len(missing)} weight(s) of the model, the first "
                        f"being {hf_name(missing[0])}")
    for name, tensor in state_dict.items():
        if name not in shapes:
            raise UserError(f"Hugging Face folder {folder} holds {name!r}, which a {model_args.n_layers}-layer "
                            f"model does not have; choose the matching model.flavor")
        if tensor.shape != shapes[name]:
            raise UserError(f"Hugging Face folder {folder}: {name} has shape {list(tensor.shape)}, the model "
                            f"expects {list(shapes[name])}; choose the matching model.flavor")
    return state_dict
