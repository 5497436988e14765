from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args, save_config, to_toml, validation_shape

__all__ = ["JobConfig", "parse_args", "save_config", "to_toml", "validation_shape"]
