"""``tensordict.TensorDict`` as a pytree node of the library's optree namespace.

Params given as a ``TensorDict`` (e.g. ``TensorDict.from_module(model)``) then work in every
transform and in ``apply_updates``, and states hold ``TensorDict``s where the params do. A node's
children are its entries in key order (a nested ``TensorDict`` is a node of its own; a ``None``
leaf, which a ``TensorDict`` stores as non-tensor data, comes back as ``None``); its structure is
its keys. Its batch size, device and dimension names are carried along and restored when the
rebuilt entries still fit them (a state entry of another shape, e.g. a 0-d step count under a
batched ``TensorDict``, gets an empty batch size instead), but they are not structure: two
``TensorDict``s with the same keys match whatever their batch sizes.

``tensordict`` is not a dependency and costs seconds to import, so it is never imported here:
the node is registered as soon as ``tensordict`` is imported, before or after
``functional_opt`` (an import hook waits for it). Only ``TensorDict`` itself is registered, not
its other subclasses of ``TensorDictBase`` (``TensorDictParams``, lazy stacks).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import optree
import torch

from functional_opt import tree

__all__ = ["is_registered", "register"]

_registered: list[type] = []


class _Meta:
    """A ``TensorDict`` node's metadata: its keys (the structure, compared and hashed) and its
    batch size, device and names (restored on rebuild, not compared)."""

    __slots__ = ("batch_size", "device", "keys", "names")

    def __init__(
        self,
        keys: tuple[str, ...],
        batch_size: torch.Size,
        device: torch.device | None,
        names: list[str | None] | None,
    ) -> None:
        self.keys = keys
        self.batch_size = batch_size
        self.device = device
        self.names = names

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Meta):
            return NotImplemented
        return self.keys == other.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return f"TensorDict(keys={list(self.keys)}, batch_size={list(self.batch_size)})"


def _flatten(td: Any) -> tuple[list[Any], _Meta, tuple[str, ...]]:
    keys = tuple(td.keys())
    children = [td[key] for key in keys]  # non-tensor data (a None leaf) as its value
    names = list(td.names) if td._has_names() else None
    return children, _Meta(keys, td.batch_size, td.device, names), keys


def _fits(value: Any, batch: torch.Size) -> bool:
    shape = getattr(value, "batch_size", None)
    if shape is None:
        shape = getattr(value, "shape", None)
    if shape is None:
        return True  # None or other non-tensor data: no shape to fit
    return len(shape) >= len(batch) and tuple(shape[: len(batch)]) == tuple(batch)


def _on(value: Any, device: torch.device) -> bool:
    where = getattr(value, "device", None)
    return where is None or where == device


def _unflatten(meta: _Meta, children: Sequence[Any]) -> Any:
    cls = _registered[0]
    source = dict(zip(meta.keys, children, strict=True))
    batch, names = meta.batch_size, meta.names
    if len(batch) and not all(_fits(v, batch) for v in children):
        batch, names = torch.Size([]), None
    device = meta.device
    if device is not None and not all(_on(v, device) for v in children):
        device = None  # never moves a tensor: a state on another device stays there
    return cls(source, batch_size=batch, device=device, names=names)


def _register(module: ModuleType) -> None:
    cls = getattr(module, "TensorDict", None)
    if not isinstance(cls, type) or _registered:
        return
    optree.register_pytree_node(
        cls,
        _flatten,  # type: ignore[arg-type]
        _unflatten,  # type: ignore[arg-type]
        namespace=tree.NAMESPACE,
    )
    _registered.append(cls)


def is_registered() -> bool:
    """Whether ``tensordict.TensorDict`` is a node of the library's trees (``tensordict`` has
    been imported)."""
    return bool(_registered)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the package ``name`` with the other finders and, once the package has run, leaves
    ``sys.meta_path`` and calls ``then(module)``."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec

        def exec_and_then(module: ModuleType) -> None:
            exec_module(module)
            self.uninstall()
            self.then(module)

        loader.exec_module = exec_and_then  # type: ignore[method-assign]
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_HOOK = _AfterImport("tensordict", _register)


def register() -> None:
    """Registers ``TensorDict`` now if ``tensordict`` is imported, else when it is (called when
    ``functional_opt`` is imported)."""
    module = sys.modules.get("tensordict")
    if module is not None and hasattr(module, "TensorDict"):
        _register(module)
    elif not _registered:
        _HOOK.install()


register()
