"""A module's layers found by its structure, for the tools that measure them per layer (the
study's early warning, the forensics replay): any LightningModule, no names assumed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_layers(module: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """The module's layers by name, in the order they were registered (a network's
    input side first, as most are written), and which of them are its blocks.

    Down through a lone child with parameters (a LightningModule holding one network);
    then its children with parameters, the largest ``ModuleList`` or ``Sequential`` among
    them (a transformer's blocks) expanded into its items, which are the blocks; where
    there is no such list, every layer is a block (an MLP's ``Sequential``: its layers
    with parameters, not the activations)."""
    node, prefix = module, ""
    while True:
        kids = [(n, c) for n, c in node.named_children() if _has_parameters(c)]
        if len(kids) != 1:
            break
        node, prefix = kids[0][1], f"{prefix}{kids[0][0]}."
    lists = [(n, c) for n, c in kids if isinstance(c, nn.ModuleList | nn.Sequential)]
    if not lists:
        layers = {f"{prefix}{n}": c for n, c in kids}
        return layers, list(layers)
    listed, largest = max(lists, key=lambda item: len(list(item[1].children())))
    layers, blocks = {}, []
    for name, child in kids:
        if name != listed:
            layers[f"{prefix}{name}"] = child
            continue
        for item, block in largest.named_children():
            if _has_parameters(block):
                layers[f"{prefix}{name}.{item}"] = block
                blocks.append(f"{prefix}{name}.{item}")
    return layers, blocks


def named_layers(module: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """The submodules ``names`` name (``blocks.0``, ``model.head``), in that order.

    Raises:
        ValueError: a name that is no submodule of ``module``, naming what is.
    """
    found = dict(module.named_modules())
    missing = [name for name in names if name not in found]
    if missing:
        layers, _ = find_layers(module)
        raise ValueError(
            f"layers {missing} are not submodules of {type(module).__name__}: give names "
            f"from its named_modules(), as {list(layers)[:8]}"
        )
    return {name: found[name] for name in names}


def l2_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of ``tensors`` together, summed in float64 (NaN: none)."""
    if not tensors:
        return math.nan
    return float(torch.stack([t.double().square().sum() for t in tensors]).sum().sqrt())
