"""Tensors of a graph module by dotted name (`layers.0.attn0.q.weight`): the one walk every part uses."""

from __future__ import annotations

import torch


def owner(root: torch.nn.Module, name: str, *, create: bool = False) -> tuple[torch.nn.Module, str]:
    """(the submodule holding `name`'s last part, that part); with create, empty submodules are added on the way."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if create and not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    return mod, leaf


def get_tensor(root: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer at `name`, or None when there is none."""
    try:
        mod, leaf = owner(root, name)
    except AttributeError:
        return None
    value = getattr(mod, leaf, None)
    return value if isinstance(value, torch.Tensor) else None


def set_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor, *, param: bool = True) -> None:
    """Register `tensor` at `name` as a frozen parameter (or a buffer), creating the submodules on the way."""
    mod, leaf = owner(root, name, create=True)
    if param:
        mod.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    else:
        mod.register_buffer(leaf, tensor)
