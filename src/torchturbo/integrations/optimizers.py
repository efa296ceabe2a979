"""A user's optimizer rebuilt for a fresh copy of the model: same class, groups and settings.

The tuner builds a new model per trial from the recipe's factories; an optimizer that a trainer
already holds (a Trainer's ``optimizers=(...)``, a LightningModule's ``configure_optimizers``)
points at the old model's parameters. Groups are matched by position: a deep copy of a model
lists its parameters in the same order as the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from torchturbo.recipe import RecipeError


def clone_optimizer(
    template: torch.optim.Optimizer, template_model: nn.Module, model: nn.Module
) -> torch.optim.Optimizer:
    """An optimizer of ``template``'s class and defaults over ``model``'s parameters, each group
    with the template group's settings (lr, weight decay, ...) and the parameters at the same
    positions. Optimizer state (moments) is not copied: a trial starts from step 0."""
    position = {id(p): i for i, p in enumerate(template_model.parameters())}
    params = list(model.parameters())
    if len(params) != len(position):
        raise RecipeError(
            f"the optimizer's model has {len(position)} parameters, the fresh copy {len(params)}: "
            "build the optimizer over the model the recipe was made from"
        )
    groups = []
    for group in template.param_groups:
        missing = [p for p in group["params"] if id(p) not in position]
        if missing:
            raise RecipeError(
                f"the optimizer holds {len(missing)} parameters that are not the model's; "
                "torchturbo rebuilds it per trial by the model's parameter order"
            )
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [params[position[id(p)]] for p in group["params"]]})
    # Every group carries every setting; the constructor gets those it takes (AdamW's defaults
    # also hold "decoupled_weight_decay", which its constructor does not accept).
    accepted = inspect.signature(type(template)).parameters
    return type(template)(groups, **{k: v for k, v in template.defaults.items() if k in accepted})


def parameter_owner(params: Iterable[nn.Parameter], model: nn.Module | None) -> nn.Module:
    """``model``, after checking that ``params`` are its own (factories are called in pairs by
    ``Recipe.build``: model first, then the optimizer over its parameters)."""
    own = {id(p) for p in model.parameters()} if model is not None else set()
    if model is None or any(id(p) not in own for p in params):
        raise RecipeError(
            "the recipe's optimizer factory got parameters of a model its model factory did not "
            "build last: call recipe.build() (model, then optimizer)"
        )
    return model
