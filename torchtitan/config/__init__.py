from torchtitan.config.job_config import JobConfig
from torchtitan.config.cli import parse_script_args
from torchtitan.config.manager import parse_args
from torchtitan.config.toml_write import save_config, to_toml
from torchtitan.config.validation import validation_shape

__all__ = ["JobConfig", "parse_args", "parse_script_args", "save_config", "to_toml", "validation_shape"]
