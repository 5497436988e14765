"""Parameter groups: every trainable parameter is classified into one named group, and each group gets its own
learning-rate scale, weight decay and matrix_method flag from `[optimizer.groups.<name>]`.

hidden_matrices  2-D (or larger) weights inside the model, e.g. the blocks' attention and feed-forward projections
output           the final projection to the vocabulary (the Linear module named `output`)
embeddings       nn.Embedding weights
norms            RMSNorm/LayerNorm weights (and biases)
other            everything else (e.g. biases of linear layers)

By default embeddings and norms get no weight decay (unless optimizer.decay_norms_and_embeddings) and only
hidden_matrices get a method's matrix treatment.
"""

import dataclasses

from torch import nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.config.job_config import OptimizerGroup
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger

GROUP_NAMES = tuple(f.name for f in dataclasses.fields(OptimizerConfig().groups))
_NORMS = (nn.RMSNorm, nn.LayerNorm)
_UNDECAYED_BY_DEFAULT = ("embeddings", "norms")


def classify(model: nn.Module) -> dict[str, str]:
    """Parameter name -> group name, for the trainable parameters of `model`."""
    groups = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if isinstance(module, nn.Embedding):
                group = "embeddings"
            elif isinstance(module, _NORMS):
                group = "norms"
            elif isinstance(module, nn.Linear) and module_name.rsplit(".", 1)[-1] == "output":
                group = "output"
            elif param.dim() >= 2:
                group = "hidden_matrices"
            else:
                group = "other"
            groups[f"{module_name}.{name}" if module_name else name] = group
    return groups


def group_weight_decay(group: str, rules: OptimizerGroup, config: OptimizerConfig) -> float:
    if rules.weight_decay is not None:
        return rules.weight_decay
    if group in _UNDECAYED_BY_DEFAULT and not config.decay_norms_and_embeddings:
        return 0.0
    return config.weight_decay


def param_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """torch parameter groups of `model`, one per non-empty group, in GROUP_NAMES order: `params`, `lr`,
    `weight_decay`, `group` (the name) and `matrix_method`."""
    by_name = dict(model.named_parameters())
    members: dict[str, list] = {name: [] for name in GROUP_NAMES}
    for param_name, group in classify(model).items():
        members[group].append(by_name[param_name])
    result = []
    for group, params in members.items():
        if not params:
            continue
        rules = getattr(config.groups, group)
        result.append({"params": params, "lr": config.lr * rules.lr_scale,
                       "weight_decay": group_weight_decay(group, rules, config), "group": group,
                       "matrix_method": rules.matrix_method})
    return result


def check_matrix_groups(method: str, groups: list[dict]) -> None:
    """For a method with a matrix treatment: every matrix_method group holds 2-D weights, and some group does."""
    for group in groups:
        if group["matrix_method"]:
            shapes = {tuple(p.shape) for p in group["params"] if p.dim() != 2}
            if shapes:
                raise UserError(f"option optimizer.groups.{group['group']}.matrix_method: true, but {method} treats "
                                f"2-D weights only and {group['group']} holds tensors of shape "
                                f"{sorted(shapes)[0]}; set it to false")
    if not any(g["matrix_method"] for g in groups):
        names = ", ".join(g["group"] for g in groups if g["params"] and g["params"][0].dim() == 2)
        raise UserError(f"option optimizer.name: {method} needs 2-D weights to treat, but no parameter group with "
                        f"them has matrix_method = true; set optimizer.groups.<group>.matrix_method = true for one of: "
                        f"{names or 'none (the model has no 2-D weights)'}")


def log_groups(groups_per_part: list[list[dict]], method: str) -> None:
    """One line per group: tensors, parameters (whole, not per shard) and its rules."""
    totals: dict[str, dict] = {}
    for groups in groups_per_part:
        for group in groups:
            entry = totals.setdefault(group["group"], {"tensors": 0, "params": 0, "group": group})
            entry["tensors"] += len(group["params"])
            entry["params"] += sum(p.numel() for p in group["params"])
    for name, entry in totals.items():
        group = entry["group"]
        logger.info(f"optimizer {method}, group {name}: {entry['tensors']} tensors, {entry['params']:,} parameters, "
                    f"lr {group['lr']:.3g}, weight decay {group['weight_decay']:g}, "
                    f"matrix_method {str(group['matrix_method']).lower()}")
