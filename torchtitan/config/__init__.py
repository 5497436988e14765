from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args, parse_script_args, save_config, to_toml, validation_shape

__all__ = ["JobConfig", "parse_args", "parse_script_args", "save_config", "to_toml", "validation_shape"]
