"""Llama 3.1 (args.py: the flavors; model.py; parallelize.py; pipeline.py: its stages; state_dict_adapter.py: its
Hugging Face format), registered as model.name = llama3."""

from torchtitan.models import register
from torchtitan.models.llama3.args import model_args_for, model_shape
from torchtitan.models.llama3.model import Transformer, flops_per_token
from torchtitan.models.llama3.parallelize import parallelize_llama, validate_parallelism
from torchtitan.models.llama3.pipeline import build_stage_module, requested_stage_count, split_into_stages
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols import ModelSpec

register(ModelSpec(
    name="llama3", build_args=model_args_for, build_model=Transformer, flops_per_token=flops_per_token,
    validate_parallelism=validate_parallelism, parallelize=parallelize_llama,
    requested_stage_count=requested_stage_count, split_into_stages=split_into_stages,
    build_stage_module=build_stage_module, model_shape=model_shape, state_dict_adapter=Llama3StateDictAdapter))
