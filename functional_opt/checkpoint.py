"""Checkpointing optimizer state as a flat ``{path: tensor}`` dict."""

from __future__ import annotations

from typing import Any

import optree
from torch import Tensor

from functional_opt import tree
from functional_opt.packed import Packed
from functional_opt.tree import PyTree

__all__ = ["state_from_dict", "state_paths", "state_to_dict"]


def _entry_name(entry: Any) -> str:
    field = getattr(entry, "field", None)
    if getattr(entry, "type", None) is not None and hasattr(entry, "entry"):
        names = getattr(entry.type, "_fields", None)
        if names is not None and isinstance(entry.entry, int):
            return str(names[entry.entry])
    if field is not None:
        return str(field)
    return str(getattr(entry, "entry", entry))


def state_paths(state: PyTree) -> list[str]:
    """Dotted names of the leaves of ``state`` (``None`` leaves included), e.g. ``1.nu.w``."""
    accessors = optree.tree_accessors(state, none_is_leaf=True, namespace=tree.NAMESPACE)
    # A packed tree's node adds no name: its leaves are named as in the unpacked tree (the
    # checkpoints of packed and unpacked states are interchangeable).
    return [
        ".".join(_entry_name(e) for e in acc if getattr(e, "type", None) is not Packed) or "<root>"
        for acc in accessors
    ]


def state_to_dict(state: PyTree) -> dict[str, Tensor]:
    """Flat ``{dotted path: tensor}`` view of every tensor in ``state`` (``None`` leaves are
    skipped). Saves with ``torch.save`` and loads with ``torch.load(weights_only=True)``."""
    values = tree.leaves(state)
    names = state_paths(state)
    out: dict[str, Tensor] = {}
    for name, value in zip(names, values, strict=True):
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"state leaf {name} is a {type(value).__name__}, not a tensor")
        if name in out:
            raise ValueError(f"two state leaves share the name {name!r}")
        out[name] = value
    return out


def state_from_dict(template_state: PyTree, d: dict[str, Tensor]) -> PyTree:
    """A state with ``template_state``'s structure and ``d``'s tensors (on the template's
    devices). Raises ``KeyError``/``ValueError`` naming every missing or extra key, or the first
    shape or dtype mismatch, before building anything."""
    values, spec = tree.flatten(template_state)
    names = state_paths(template_state)
    expected = {n for n, v in zip(names, values, strict=True) if v is not None}
    missing = sorted(expected - set(d))
    extra = sorted(set(d) - expected)
    if missing or extra:
        raise KeyError(f"state_from_dict: missing keys {missing}, unexpected keys {extra}")
    out: list[Any] = []
    for name, ref in zip(names, values, strict=True):
        if ref is None:
            out.append(None)
            continue
        got = d[name]
        if not isinstance(got, Tensor):
            raise ValueError(f"state_from_dict: {name} is a {type(got).__name__}, not a tensor")
        if got.shape != ref.shape:
            raise ValueError(
                f"state_from_dict: {name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )
        if got.dtype != ref.dtype:
            raise ValueError(f"state_from_dict: {name} has dtype {got.dtype}, expected {ref.dtype}")
        out.append(got.to(ref.device, copy=True) if got.device != ref.device else got.clone())
    return tree.unflatten(spec, out)
