"""Conversion between our Llama 3.1 state dicts and Hugging Face `LlamaForCausalLM` checkpoints.

Our model rotates consecutive pairs of each query/key head (Meta's layout); Hugging Face's rotates dimension `i`
with dimension `i + head_dim / 2` ("rotate half"). The two compute the same attention once the rows of `wq` and
`wk` are permuted within each head: Meta row `2j` becomes HF row `j`, Meta row `2j + 1` becomes HF row
`head_dim / 2 + j`. Every other weight is only renamed. The folder format is generic:
torchtitan/components/checkpoint/hf_folder.py.
"""

import math
import re
from pathlib import Path

import torch

from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.protocols import StateDictAdapter

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


class Llama3StateDictAdapter(StateDictAdapter):
    """Our Llama 3.1 parameters <-> `LlamaForCausalLM`'s, for the shapes of `model_args`."""

    def __init__(self, model_args: TransformerModelArgs):
        self.model_args = model_args

    def hf_name(self, name: str) -> str:
        if name in _TOP_LEVEL_NAMES:
            return _TOP_LEVEL_NAMES[name]
        match = _OUR_LAYER.match(name)
        if match is None or match.group(2) not in _LAYER_NAMES:
            raise UserError(f"state dict entry {name!r} is not a Llama 3 parameter; expected names like "
                            f"{', '.join(list(_TOP_LEVEL_NAMES) + ['layers.N.' + s for s in _LAYER_NAMES])}")
        layer, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"

    def our_name(self, hf_name: str) -> str | None:
        if hf_name.endswith(_HF_IGNORED_SUFFIX):
            return None
        top_level = {hf: ours for ours, hf in _TOP_LEVEL_NAMES.items()}
        if hf_name in top_level:
            return top_level[hf_name]
        layer_names = {hf: ours for ours, hf in _LAYER_NAMES.items()}
        match = _HF_LAYER.match(hf_name)
        if match is None or match.group(2) not in layer_names:
            raise UserError(f"Hugging Face tensor {hf_name!r} is not a LlamaForCausalLM parameter; expected "
                            f"names like {', '.join(list(top_level) + ['model.layers.N.' + s for s in layer_names])}")
        layer, hf_suffix = match.groups()
        return f"layers.{layer}.{layer_names[hf_suffix]}"

    def row_groups(self, name: str) -> int | None:
        """The query and key heads, whose rows RoPE rotates in pairs (ours) or in halves (HF)."""
        if name.endswith("attention.wq.weight"):
            return self.model_args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.model_args.kv_heads
        return None

    def to_hf_rows(self, rows: torch.Tensor, groups: int) -> torch.Tensor:
        count, cols = rows.shape
        head_dim = count // groups
        return rows.view(groups, head_dim // 2, 2, cols).transpose(1, 2).reshape(count, cols)

    def from_hf_rows(self, rows: torch.Tensor, groups: int) -> torch.Tensor:
        count, cols = rows.shape
        head_dim = count // groups
        return rows.view(groups, 2, head_dim // 2, cols).transpose(1, 2).reshape(count, cols)

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        """The `config.json` of a `LlamaForCausalLM` with our model's shapes."""
        model_args = self.model_args
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

    def check_hf_config(self, config: dict, path: Path) -> None:
        model_args = self.model_args
        expected = self.hf_config()
        for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size"):
            # HF omits num_key_value_heads when it equals num_attention_heads.
            saved = config.get(field, config.get("num_attention_heads") if field == "num_key_value_heads" else None)
            if saved != expected[field]:
                raise UserError(f"Hugging Face config {path}: {field} is {saved}, but the model (flavor with "
                                f"vocab_size {model_args.vocab_size}) needs {expected[field]}; choose the matching "
                                f"model.flavor (and [model] shape options)")
        # The shapes match whatever these are, so a mismatch would load silently and give other logits.
        # An absent entry means transformers' default, which is what transformers would compute with.
        theta, scaling = _hf_rope(config)
        absent = " (absent: transformers' default)"
        if not _same(_HF_DEFAULT_ROPE_THETA if theta is None else theta, model_args.rope_theta):
            shown = f"{_HF_DEFAULT_ROPE_THETA}{absent}" if theta is None else theta
            raise UserError(f"Hugging Face config {path}: rope_theta is {shown}, but the model uses "
                            f"{model_args.rope_theta:g}; the weights were trained with other rotary embeddings than "
                            f"this model.flavor computes, choose the matching flavor (or set model.rope_theta)")
        eps = config.get("rms_norm_eps")
        if not _same(_HF_DEFAULT_RMS_NORM_EPS if eps is None else eps, model_args.norm_eps):
            shown = f"{_HF_DEFAULT_RMS_NORM_EPS}{absent}" if eps is None else eps
            raise UserError(f"Hugging Face config {path}: rms_norm_eps is {shown}, but the model uses "
                            f"{model_args.norm_eps:g}; choose the matching model.flavor")
        _check_rope_scaling(path, scaling, expected["rope_scaling"])

    def expected_shapes(self) -> dict[str, torch.Size]:
        """Computed on the meta device, without memory."""
        with torch.device("meta"):
            model = Transformer(self.model_args)
        return {name: param.shape for name, param in model.named_parameters()}


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
