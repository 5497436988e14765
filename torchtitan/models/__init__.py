"""The model families, by name (model.name): each registers its `ModelSpec` (torchtitan/protocols.py) when its
package is imported. llama3 is this project's; another family registers itself from a module that
job.custom_import names."""

import importlib

from torchtitan.config import JobConfig
from torchtitan.errors import UserError
from torchtitan.protocols import ModelSpec

_specs: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    if spec.name in _specs:
        raise ValueError(f"model family {spec.name!r} is registered already")
    _specs[spec.name] = spec


def get(name: str) -> ModelSpec:
    if name not in _specs:
        raise UserError(f"option model.name: {name!r} is not one of {', '.join(map(repr, _specs))}")
    return _specs[name]


def spec_of(config: JobConfig) -> ModelSpec:
    """The family that model.name names, once the module of job.custom_import (which may register it) is imported."""
    module = config.job.custom_import
    if module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise UserError(f"option job.custom_import: {module!r} cannot be imported ({err}); give a dotted module "
                            f"name importable from the working directory or PYTHONPATH") from None
    return get(config.model.name)


from torchtitan.models import llama3  # noqa: E402,F401  (registers itself)
