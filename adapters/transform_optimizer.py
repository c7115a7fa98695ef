"""``TransformOptimizer``: a ``torch.optim.Optimizer`` that runs any ``GradientTransformation``.

Each step builds the transform's state from the optimizer's storage, calls the pure
``tx.update`` once per param group (the same math as the functional core, no second
implementation) and writes the results back in place: ``p += u`` with ``torch._foreach_add_``
and the new state into the old buffers with ``torch._foreach_copy_`` (for ``DTensor`` params and
state, e.g. under FSDP2, on their local shards).

State layout (what ``state_dict()`` saves, in torch's own format):

* **Per-parameter state** (moments, accumulators) lives in ``self.state[p]`` under readable
  names: the shortest unique suffix of its path in the transform's state (``"mu"``, ``"nu"``
  for Adam), optionally renamed by :attr:`TransformOptimizer.state_names`. It is created on a
  parameter's first gradient (like torch's optimizers); a parameter that never had a gradient
  has no entry. The transform is initialised with the group's params wrapped in
  :class:`ParamSlots`, an optree node in ``functional_opt.tree.NAMESPACE``, so every
  per-parameter subtree of its state is a ``ParamSlots`` and is told apart from group-level
  leaves by type, not by guessing from shapes.
* **Group-level state** (update counters and any other leaf not per parameter) lives in the
  param-group dict, under ``group["transform_state"]`` (a ``{name: tensor}`` dict). It is one
  value per group, so it sits where torch keeps per-group data: ``state_dict()`` /
  ``load_state_dict()`` carry it with the group (``load_state_dict`` deep-copies groups), and
  ``torch.distributed.checkpoint`` keeps per-parameter state keyed by parameter and param-group
  entries per group. No per-parameter copies have to be kept consistent.
* **Hyperparameters** are the group's options (plain Python numbers, what LR schedulers read
  and write); before every step they are written with ``Tensor.fill_`` into the transform's
  injected hyperparameter tensors, which are rebuilt from the options rather than saved.
  Options that are not plain data (functions) are not saved either: they come from the code
  that built the optimizer. A ready-made transform's groups have an ``lr`` too, which scales its
  updates relative to the learning rate it was built with (see :class:`TransformOptimizer`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast, overload

import optree
import torch
from torch import Tensor
from torch.optim.optimizer import required

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    DONATE,
    GradientTransformation,
    Stages,
    UnknownStepSize,
    extra_keywords,
    fusable,
    has_leaf_labels,
    pinned,
    step_size,
)
from functional_opt.checkpoint import state_paths
from functional_opt.leaf_step import GIVEN, LOW_PRECISION
from functional_opt.transforms.hyperparams import InjectHyperparamsState, inject_hyperparams

from .label_parts import LabelParts, label_parts
from .packed_group import (
    NotPackable,
    PackedGroup,
    flatten_to_packed,
    packable,
    shards_of,
    template_shapes,
    templates_by_name,
)

__all__ = ["GROUP_STATE_KEY", "ParamSlots", "TransformOptimizer"]

_GRAD = operator.attrgetter("grad")

GROUP_STATE_KEY = "transform_state"
"""Param-group key of the group-level transform state (counters), a ``{name: tensor}`` dict."""

HYPERPARAM_DTYPE = torch.float64
"""Dtype of injected float hyperparameters: that of the Python floats torch.optim uses."""


class ParamSlots(tuple[Any, ...]):
    """The params (or updates, or one per-parameter state leaf each) of one param group.

    A tuple registered as an optree node in ``functional_opt.tree.NAMESPACE``: the transform is
    initialised with ``ParamSlots(params)``, so each per-parameter subtree of its state is a
    ``ParamSlots`` too (one entry per param, ``None`` where a param has no such state).
    """

    __slots__ = ()


optree.register_pytree_node(
    ParamSlots,
    lambda s: (tuple(s), None, tuple(range(len(s)))),
    lambda _, children: ParamSlots(children),
    namespace=tree.NAMESPACE,
)


_UNSET = object()


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def _is_slots(x: Any) -> bool:
    return isinstance(x, ParamSlots)


def _flatten_outer(state: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``state`` down to its ``ParamSlots`` nodes and group-level leaves."""
    return optree.tree_flatten(
        state, is_leaf=_is_slots, none_is_leaf=True, namespace=tree.NAMESPACE
    )


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.dim() == 0)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _short_names(paths: Sequence[tuple[str, ...]]) -> list[str]:
    """For each path, its shortest suffix that is no other path's suffix (else the whole path)."""
    out = []
    for i, path in enumerate(paths):
        suffix = path
        for k in range(1, len(path) + 1):
            suffix = path[-k:]
            if not any(j != i and other[-k:] == suffix for j, other in enumerate(paths)):
                break
        out.append(".".join(suffix))
    return out


# --------------------------------------------------------------------------------------------
# The learning rate of a ready-made transform.


def _learning_rate(tx: GradientTransformation, owner: str) -> float:
    """The learning rate a ready-made ``tx`` was built with: the magnitude of the constant
    factor of its last stage(s); raises ``ValueError`` (saying how to write it) if none."""
    try:
        factor = abs(step_size(tx).factor)
        if not (math.isfinite(factor) and factor > 0):
            raise UnknownStepSize(f"its learning rate is {factor}")
    except UnknownStepSize as why:
        raise ValueError(
            f"{owner}: cannot find the learning rate of this transform ({why}), so param "
            "groups' 'lr' (what LR schedulers set) could not drive its step. Pass a factory and "
            "its options instead, e.g. TransformOptimizer(params, fo.adam, lr=1e-3) (then any "
            "factory argument is a group option), or end the transform in a constant learning "
            "rate, e.g. fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-3)) or "
            "fo.chain(..., fo.scale_by_learning_rate(1e-3)); schedule it with torch.optim."
            "lr_scheduler rather than a schedule inside the transform."
        ) from None
    return factor


# --------------------------------------------------------------------------------------------
# Plain data in checkpoints.

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is tensors and plain data only (what ``torch.load(weights_only=True)``
    reads back): never a function or another object."""
    if isinstance(value, (Tensor, *_PLAIN_SCALARS)):
        return True
    if type(value) in (list, tuple, torch.Size):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in value.items())
    return False


@dataclass
class _Slot:
    """One leaf of the state structure with ``ParamSlots`` nodes kept whole."""

    kind: str  # "param" (a ParamSlots), "group" (a group-level tensor), "hyper", "none"
    name: str  # state name ("param"/"group") or factory argument ("hyper")


class _StateTable:
    """What the optimizer's state table held when a step of one group ended, with the
    indices of the params that had a gradient then (each had its full state): while the table
    holds the same keys, dicts and dict sizes, in the same order, those params still do, found
    by identity checks instead of a lookup per param (a tensor's hash is a Python call)."""

    def __init__(self) -> None:
        self.seen: tuple[Any, list[Any], list[Any], list[int], list[int]] | None = None

    def forget(self) -> None:
        self.seen = None

    def record(self, state: Any, present: list[int]) -> None:
        values = list(state.values())
        self.seen = (state, list(state), values, list(map(len, values)), present)

    def holds(self, state: Any, present: list[int]) -> bool:
        seen = self.seen
        if seen is None or state is not seen[0] or len(state) != len(seen[1]):
            return False
        return (
            present == seen[4]
            and all(map(operator.is_, state, seen[1]))
            and all(map(operator.is_, state.values(), seen[2]))
            and list(map(len, seen[2])) == seen[3]
        )


@dataclass
class _Layout:
    """How one param group's transform state maps onto the optimizer's storage."""

    group: dict[str, Any]
    param_ids: list[int]
    signature: dict[str, tuple[bool, Any]]
    tx: GradientTransformation
    spec: optree.PyTreeSpec
    slots: list[_Slot]
    hyper: dict[str, Tensor]
    numeric: dict[str, str]  # group option -> injected hyperparameter (factory argument)
    stand_ins: list[Tensor]  # meta tensors shaped like the params
    param_template: list[dict[str, Tensor]]  # per param: state name -> meta tensor
    group_template: dict[str, Tensor]
    template_shapes: list[torch.Size | bool]  # per param: packed_group.template_shapes
    full_states: _StateTable = field(default_factory=_StateTable)
    scratch: dict[str, Tensor] = field(default_factory=dict)
    checked: dict[str, Any] = field(default_factory=dict)  # numeric option -> value validated
    engine: Any = None  # the group's PackedGroup once made; False: the group cannot use one


class TransformOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` running a ``GradientTransformation``.

    ``transform_or_factory`` is a factory such as ``functional_opt.adam`` or
    ``functional_opt.dreamerv3``, or a ready-made transform (used as is for every group).

    **A factory**: the optimizer's options are the factory's arguments (``defaults`` overrides
    their defaults; a param-group dict overrides both), except that ``learning_rate`` is exposed
    as ``lr`` (as in torch.optim, so LR schedulers find it; ``learning_rate=`` is accepted and
    stored as ``lr``); a factory without a learning-rate argument is refused (``TypeError``).
    Each group runs ``inject_hyperparams(factory, static_args=<non-numeric options>)(**options)``,
    and before every step its numeric options (``group["lr"]`` as set by any
    ``torch.optim.lr_scheduler``) are checked as the factory checks them (when they changed) and
    written into the injected hyperparameter tensors in place. A list option with one entry per
    param (a mask) and a callable option's list result are passed to the transform as
    :class:`ParamSlots`, i.e. with the structure of the group's params.

    **A ready-made transform** takes no options, but its groups have an ``lr`` all the same:
    the learning rate it was built with (``fo.adam(1e-3)``: ``1e-3``), read at construction from
    what the transform declares about its updates (:func:`functional_opt.base.step_size`): the
    step size of a final ``scale`` (what ``scale_by_learning_rate`` and the aliases end with;
    several trailing ones multiply), or dreamerv3's ``lr`` (its warm-up and decay are factors on
    top), through ``chain``, ``named_chain``, ``apply_if_finite`` and ``MultiSteps``. A step
    then applies
    ``p <- p + (group["lr"] / built_lr) * u``: the update of the transform built with
    ``group["lr"]`` (to float32 rounding; bit for bit while the two are equal), so LR schedulers,
    a param-group ``"lr"`` and ``lr = 0`` (params frozen) drive it. A transform whose learning
    rate cannot be found that way (no constant factor at its end, a schedule built into it, a
    ``masked``/``partition`` whose other leaves are not scaled) raises ``ValueError`` at
    construction saying how to write it: pass the factory, or end the transform in a constant
    learning rate. ``group["lr"]`` is never silently ignored.

    ``step`` computes ``u = tx.update(g, state, params)`` with ``g = p.grad`` (``None`` for a
    param without a gradient: no update, its state carried, counters still advance) and applies
    ``p <- p + u``. Each group keeps its own update counters; a step where no param has a
    gradient raises ``RuntimeError``.

    **Nothing half-done.** ``add_param_group`` checks the new group (its options, by building
    its transform, and any group-level state it brings) before adding it. ``step`` checks every
    group's options and gradients (sparse, or shaped unlike their param) before any group
    changes, so a bad group raises with every param and all state as they were; state created
    for params on their first gradient is dropped again if their update raises. (An exception
    raised inside a transform's own update after these checks, e.g. a user's transform failing,
    can still leave state it already wrote in place.) ``load_state_dict`` checks everything first.

    **Checkpoints** hold tensors and plain data only (``torch.load(weights_only=True)``): options
    that are not plain data (a ``mask`` function) are left out of ``state_dict()`` and
    ``load_state_dict`` keeps this optimizer's values for them, i.e. rebuilds them from the code
    that constructed it, as torch.optim does with what it does not save.

    Subclasses may set :attr:`options`, :attr:`state_names`, :attr:`group_defaults` and
    :attr:`upcast_16bit_grads`.
    """

    options: ClassVar[Mapping[str, str] | None] = None
    """Exposed group option -> factory argument. ``None``: every factory argument, under its
    own name (``learning_rate`` as ``lr``). Arguments left out keep the factory's default."""

    state_names: ClassVar[Mapping[str, str]] = {}
    """Renames of state entries (e.g. ``{"nu": "rms"}``), applied to the default names."""

    group_defaults: ClassVar[Mapping[str, Any]] = {}
    """Extra param-group defaults that are not transform options."""

    upcast_16bit_grads: ClassVar[bool] = False
    """Feed float16/bfloat16 gradients to the transform in float32."""

    fused_steps: bool = True
    """Step groups on the engine where possible (see :mod:`functional_opt.adapters.packed_group`):
    a fusable transform (``functional_opt.base.fusable``: the library's elementwise transforms
    and chains of them) over plain dense params on one device, every gradient present, runs as
    one compiled update over flat gradient and state buffers, and ``optimizer.state[p]`` holds
    views of those buffers. The first such step compiles (seconds), so only groups of at least
    ``fused_min_numel`` elements (default ``2**20``) take it; smaller ones step through the
    per-tensor path, which is as fast for them. Set ``fused_steps = False`` (on the class or
    the instance) to step every group through the per-tensor path."""

    fused_min_numel: int = 2**20
    """The smallest group (in elements) that steps on the engine (see :attr:`fused_steps`)."""

    direct_min_numel: int = 2**15
    """On the engine, with a transform that treats every leaf on its own
    (``functional_opt.base.leafwise``: ``adam``, ``adamw`` without a mask, ``sgd``,
    ``dreamerv3``...), params of at least this many elements step one at a time in their own
    storage: one compiled call each reads the gradient where it is and writes the param in
    place, instead of copying the gradient into a buffer and adding the update back (see
    :mod:`functional_opt.adapters.packed_group`). ``0`` turns that off."""

    direct_rest_max: int = 8
    """With the direct route on (:attr:`direct_min_numel`), when at most this many params of a
    group would be packed beside its direct ones (the small ones: biases, norms' scales), they
    step directly too: a compiled call each (about 10-30 us) costs less than the packed route's
    gradient copy and its calls through dynamo (about 0.3 ms each; a sharded group makes two,
    its partials and its step). ``0``: small params are always packed."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        transform_or_factory: GradientTransformation | Callable[..., GradientTransformation],
        **defaults: Any,
    ) -> None:
        self._layouts: list[_Layout | None] = []
        self._base_lr: float | None = None
        if isinstance(transform_or_factory, GradientTransformation):
            self._factory: Callable[..., GradientTransformation] | None = None
            self._transform: GradientTransformation | None = transform_or_factory
            self._option_args: dict[str, str] = {}
            if defaults:
                raise TypeError(
                    f"{type(self).__name__}: options {sorted(defaults)} need a factory (e.g. "
                    "functional_opt.adam); a ready-made transform has its hyperparameters built "
                    "in (its param groups' 'lr' scales its step)"
                )
            self._base_lr = _learning_rate(transform_or_factory, type(self).__name__)
            all_defaults: dict[str, Any] = {"lr": self._base_lr}
        elif callable(transform_or_factory):
            self._factory = transform_or_factory
            self._transform = None
            self._option_args, factory_defaults = self._factory_options(transform_or_factory)
            if "lr" not in self._option_args:
                raise TypeError(
                    f"{type(self).__name__}: the factory {_name(transform_or_factory)} has no "
                    "learning-rate argument (learning_rate or lr), so param groups' 'lr' (what LR "
                    "schedulers set) could not drive its step; use a factory that takes one (e.g. "
                    "fo.adam), or pass a ready-made transform that ends in a constant learning "
                    "rate"
                )
            self._rename_learning_rate(defaults)
            unknown = sorted(set(defaults) - set(self._option_args))
            if unknown:
                raise TypeError(
                    f"{type(self).__name__}: unexpected options {unknown}; the options are "
                    f"{sorted(self._option_args)}"
                )
            all_defaults = {**factory_defaults, **defaults}
        else:
            raise TypeError(
                "transform_or_factory must be a GradientTransformation or a factory returning "
                f"one, got {type(transform_or_factory).__name__}"
            )
        for key, value in self.group_defaults.items():
            all_defaults.setdefault(key, value)
        super().__init__(params, all_defaults)

    def _rename_learning_rate(self, options: dict[str, Any]) -> None:
        """Accept the factory's ``learning_rate`` for the ``lr`` option (stored as ``lr``)."""
        if self._option_args.get("lr") == "learning_rate" and "learning_rate" in options:
            if "lr" in options:
                raise TypeError("give either lr or learning_rate, not both")
            options["lr"] = options.pop("learning_rate")

    def _factory_options(
        self, factory: Callable[..., GradientTransformation]
    ) -> tuple[dict[str, str], dict[str, Any]]:
        """``{option: factory argument}`` and ``{option: default}`` (``required`` if none)."""
        parameters = {
            name: p
            for name, p in inspect.signature(factory).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not name.startswith("_")
        }
        if self.options is None:
            mapping = {("lr" if n == "learning_rate" else n): n for n in parameters}
        else:
            mapping = dict(self.options)
            missing = sorted(set(mapping.values()) - set(parameters))
            if missing:
                raise TypeError(f"options map to {missing}, which are not arguments of {factory}")
        defaults = {
            option: required
            if parameters[arg].default is inspect.Parameter.empty
            else parameters[arg].default
            for option, arg in mapping.items()
        }
        return mapping, defaults

    # ----------------------------------------------------------------------------------------
    # Layout: the transform of a group and where each piece of its state is stored.

    def _signature(self, group: dict[str, Any]) -> dict[str, tuple[bool, Any]]:
        """Per option: numeric (then its type matters) or static (then its value does)."""
        out = {}
        for option in self._option_args:
            value = group[option]
            numeric = _is_number(value)
            out[option] = (True, type(value)) if numeric else (False, value)
        return out

    def _build_transform(
        self, group: dict[str, Any], n: int
    ) -> tuple[GradientTransformation, dict[str, str]]:
        if self._factory is None:
            assert self._transform is not None
            self._check_lr(group)
            return self._transform, {}
        factory = self._factory
        args = self._validate_options(group, n)
        static = [arg for arg, value in args.items() if not _is_number(value)]
        # The factory's arguments that are no option (of a subclass's ``options``) keep their
        # defaults for good: fixed, not injected (a weight decay of 0.0 then costs nothing)
        static += [
            name
            for name, p in inspect.signature(factory).parameters.items()
            if name not in args and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        numeric = {o: a for o, a in self._option_args.items() if a not in static}
        tx = inject_hyperparams(factory, static_args=static, hyperparam_dtype=HYPERPARAM_DTYPE)
        return tx(**args), numeric

    def _validate_options(self, group: dict[str, Any], n: int) -> dict[str, Any]:
        """The factory's arguments for ``group``; the factory is built from them once, which
        validates them (``ValueError`` naming the option)."""
        assert self._factory is not None
        args = {arg: self._adapt(group[option], n) for option, arg in self._option_args.items()}
        try:
            self._factory(**args)
        except ValueError as err:
            renamed = {o: a for o, a in self._option_args.items() if o != a}
            note = f" (options map to arguments as {renamed})" if renamed else ""
            raise ValueError(f"{type(self).__name__}: {err}{note}") from err
        return args

    def _check_lr(self, group: Mapping[str, Any]) -> None:
        """A ready-made transform's group ``lr``: a finite number ``>= 0`` (or a 0-d tensor)."""
        if "lr" not in group:
            raise ValueError(f"{type(self).__name__}: a param group has no 'lr'")
        try:
            _validate.non_negative("lr", group["lr"])
        except ValueError as err:
            raise type(err)(f"{type(self).__name__}: param group {err}") from None

    def _check_values(self, layout: _Layout, group: dict[str, Any]) -> None:
        """Checks the group's numeric options before a step: a value that changed since it
        was last checked (an LR scheduler's, a user's) is validated as the factory does."""
        if self._factory is None:
            self._check_lr(group)
            return
        checked = layout.checked
        for option in layout.numeric:
            value, old = group[option], checked.get(option, _UNSET)
            if value is old or (not isinstance(value, Tensor) and _same(value, old)):
                continue
            self._validate_options(group, len(layout.stand_ins))
            layout.checked = {o: group[o] for o in layout.numeric}
            return

    @staticmethod
    def _adapt(value: Any, n: int) -> Any:
        """A per-param list (mask, labels) as ``ParamSlots``; a callable's list result too."""
        if isinstance(value, list) and len(value) == n:
            return ParamSlots(value)
        if callable(value) and not isinstance(value, type):
            fn = value

            def adapted(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                if isinstance(out, (list, tuple)) and len(out) == n:
                    return ParamSlots(out)
                return out

            return adapted
        return value

    def _build_layout(self, group: dict[str, Any]) -> _Layout:
        params: list[Tensor] = group["params"]
        tx, numeric = self._build_transform(group, len(params))
        stand_ins = [torch.empty_like(p, device="meta") for p in params]
        init = tx.init(ParamSlots(stand_ins))
        outer, spec = _flatten_outer(init)
        hyper: dict[str, Tensor] = (
            dict(init.hyperparams) if isinstance(init, InjectHyperparamsState) else {}
        )
        hyper_ids = {id(v): k for k, v in hyper.items()} if numeric else {}
        paths = state_paths(optree.tree_unflatten(spec, [0] * len(outer)))
        kinds = []
        for leaf in outer:
            if isinstance(leaf, ParamSlots):
                kinds.append("param")
            elif leaf is None:
                kinds.append("none")
            elif id(leaf) in hyper_ids:
                kinds.append("hyper")
            elif isinstance(leaf, Tensor):
                kinds.append("group")
            else:
                raise TypeError(f"state leaf {paths[len(kinds)]} is a {type(leaf).__name__}")
        names: dict[int, str] = {}
        for kind in ("param", "group"):
            index = [i for i, k in enumerate(kinds) if k == kind]
            short = _short_names([tuple(paths[i].split(".")) for i in index])
            renamed = [self.state_names.get(s, s) for s in short]
            if len(set(renamed)) != len(renamed):
                raise ValueError(f"state names {renamed} are not unique")
            names.update(zip(index, renamed, strict=True))
        slots = [
            _Slot(k, hyper_ids[id(leaf)] if k == "hyper" else names.get(i, ""))
            for i, (k, leaf) in enumerate(zip(kinds, outer, strict=True))
        ]
        param_template: list[dict[str, Tensor]] = [{} for _ in params]
        group_template: dict[str, Tensor] = {}
        for slot, leaf in zip(slots, outer, strict=True):
            if slot.kind == "param":
                for j, value in enumerate(leaf):
                    if value is not None and not isinstance(value, Tensor):
                        raise TypeError(
                            f"per-parameter state {slot.name} must be one tensor per parameter, "
                            f"got a {type(value).__name__}"
                        )
                    if value is not None:
                        param_template[j][slot.name] = value
            elif slot.kind == "group":
                group_template[slot.name] = leaf
        if any(t.device.type == "meta" for t in group_template.values()):
            real, _ = _flatten_outer(tx.init(ParamSlots(params)))
            group_template = {
                s.name: v for s, v in zip(slots, real, strict=True) if s.kind == "group"
            }
        return _Layout(
            group=group,
            param_ids=[id(p) for p in params],
            signature=self._signature(group),
            tx=tx,
            spec=spec,
            slots=slots,
            hyper=hyper,
            numeric=numeric,
            stand_ins=stand_ins,
            param_template=param_template,
            group_template=group_template,
            template_shapes=template_shapes(param_template),
            checked={option: group[option] for option in numeric},
        )

    def _layout(self, index: int, group: dict[str, Any]) -> _Layout:
        """The cached layout of a group; rebuilt (and the stored state checked against it) when
        the group object, its params or its non-numeric options changed."""
        while len(self._layouts) <= index:
            self._layouts.append(None)
        layout = self._layouts[index]
        if (
            layout is not None
            and layout.group is group
            and list(map(id, group["params"])) == layout.param_ids
            and all(
                numeric == old[0] and _same(value, old[1])
                for (numeric, value), old in zip(
                    self._signature(group).values(), layout.signature.values(), strict=True
                )
            )
        ):
            self._check_values(layout, group)
            return layout
        layout = self._build_layout(group)
        self._check_param_states(layout, {p: self.state.get(p, {}) for p in group["params"]})
        self._init_group_state(group, layout, existing=True)
        self._layouts[index] = layout
        return layout

    # ----------------------------------------------------------------------------------------
    # Group-level state: in ``group[GROUP_STATE_KEY]``; subclasses may store it elsewhere.

    def _init_group_state(self, group: dict[str, Any], layout: _Layout, existing: bool) -> None:
        """Create ``group``'s group-level state, or (``existing``, or when the group dict
        brings one) check and normalise the stored one against the layout."""
        stored = group.get(GROUP_STATE_KEY)
        if stored is None and not existing:
            group[GROUP_STATE_KEY] = {k: v.clone() for k, v in layout.group_template.items()}
            return
        if not isinstance(stored, dict):
            raise ValueError(
                f"param group has no valid {GROUP_STATE_KEY!r} entry (the group-level state "
                f"{sorted(layout.group_template)}); got {type(stored).__name__}"
            )
        checked = _checked(stored, layout.group_template, "group-level state")
        if not existing:  # a new group bringing its state: never share it with its source
            checked = {k: v.clone() for k, v in checked.items()}
        group[GROUP_STATE_KEY] = checked

    def _group_state_in(self, group: dict[str, Any], layout: _Layout) -> dict[str, Tensor]:
        """The group-level state tensors for this step; the step copies new values into them."""
        state: dict[str, Tensor] = group[GROUP_STATE_KEY]
        return state

    def _group_state_out(self, group: dict[str, Any], layout: _Layout) -> None:
        """Called after each update of ``group`` (the tensors were updated in place)."""

    # ----------------------------------------------------------------------------------------
    # Per-parameter state.

    @staticmethod
    def _check_param_states(layout: _Layout, states: Mapping[Tensor, Mapping[str, Any]]) -> None:
        for j, p in enumerate(layout.group["params"]):
            entries = states.get(p, {})
            if not entries:  # no gradient yet: created on its first one
                continue
            template = layout.param_template[j]
            unexpected = sorted(set(entries) - set(template))
            if unexpected:
                raise ValueError(
                    f"parameter {j} of a group has unexpected state {unexpected}; this "
                    f"optimizer keeps {sorted(template)}"
                )
            if len(entries) != len(template):
                raise ValueError(
                    f"parameter {j} of a group has state {sorted(entries)}, expected all of "
                    f"{sorted(template)} or none"
                )
            _checked(dict(entries), template, f"state of parameter {j}")

    def _init_param_states(self, layout: _Layout, params: list[Tensor], need: list[int]) -> None:
        """Fresh per-parameter state for ``params[j]``, ``j`` in ``need`` (first gradient)."""
        wanted = set(need)
        try:
            inputs = [p if j in wanted else layout.stand_ins[j] for j, p in enumerate(params)]
            outer, _ = _flatten_outer(layout.tx.init(ParamSlots(inputs)))
        except (RuntimeError, NotImplementedError):  # an init that cannot mix meta tensors
            outer, _ = _flatten_outer(layout.tx.init(ParamSlots(params)))
        for slot, leaf in zip(layout.slots, outer, strict=True):
            if slot.kind == "param":
                for j in need:
                    if leaf[j] is not None:
                        self.state[params[j]][slot.name] = leaf[j]

    # ----------------------------------------------------------------------------------------
    # Param groups, step, checkpoints.

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch semantics). Everything is checked first (its options, by building
        its transform, and any group-level state it brings): a bad group raises and is not
        added."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        self._rename_learning_rate(param_group)
        params = param_group.get("params")
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set) or params is None:
            raise TypeError(
                "optimizer params need to be organized in ordered collections, but the ordering "
                f"of tensors in sets will change between runs; got {type(params).__name__}"
            )
        params = param_group["params"] = list(params)
        # (name, param) pairs: torch's named parameters
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
        for p in tensors:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
        missing = [k for k, v in self.defaults.items() if v is required and k not in param_group]
        if missing:
            raise ValueError(
                "parameter group didn't specify a value of required optimization parameter "
                f"{missing[0]}"
            )
        candidate = {**self.defaults, **param_group, "params": tensors}
        layout = self._build_layout(candidate)
        self._init_group_state(dict(candidate), layout, existing=False)
        super().add_param_group(param_group)  # its own checks come before it adds the group
        group = self.param_groups[-1]
        layout.group = group
        self._init_group_state(group, layout, existing=False)
        while len(self._layouts) < len(self.param_groups):
            self._layouts.append(None)
        self._layouts[len(self.param_groups) - 1] = layout

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group: ``p <- p + tx.update(p.grad, state, params)``.

        ``closure`` (re-evaluates the model, calls ``backward``, returns the loss) runs first,
        under ``torch.enable_grad()``; its loss is returned. Raises ``RuntimeError`` when no
        param has a gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not any(p.grad is not None for g in self.param_groups for p in g["params"]):
            raise RuntimeError(f"{type(self).__name__}.step: no parameter has a gradient")
        groups = self.param_groups
        # All or nothing: every group is checked before any group changes. The first group's
        # own step checks it before it changes anything, so it is not checked twice.
        for index in range(1, len(groups)):
            self._check_group(index, groups[index])
        for index, group in enumerate(groups):
            self._step_group(index, group)
        return loss

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """Raises if stepping ``group`` would fail on its options or gradients (called for
        every group before any group steps); changes nothing."""
        self._layout(index, group)
        for j, p in enumerate(group["params"]):
            self._check_grad(index, j, p, p.grad)

    def _check_grad(self, index: int, j: int, p: Tensor, g: Tensor | None) -> None:
        if g is None:
            return
        if g.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if g.shape != p.shape:
            raise ValueError(
                f"{type(self).__name__}: the gradient of parameter {j} of param group {index} "
                f"has shape {tuple(g.shape)}, its parameter {tuple(p.shape)}"
            )

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        layout = self._layout(index, group)
        params: list[Tensor] = group["params"]
        engine = layout.engine
        if isinstance(engine, PackedGroup) and self.fused_steps:
            usual = engine.usual_grads(params, self.state)
            if usual is not None:  # checked on the step that made it usual
                self._update_group(layout, group, params, usual[0], usual[1])  # type: ignore[arg-type]
                return
        # (over 2000 params, a Python loop of these checks cost as much as the step's kernels:
        # each reads one attribute column, and the state table is looked up per param only
        # when it changed since the last step, whose params had their full state then)
        grads: list[Tensor | None] = list(map(_GRAD, params))
        present = [j for j, g in enumerate(grads) if g is not None]
        if len(present) == len(params):
            ps, gs = params, cast(list[Tensor], grads)
        else:
            ps, gs = [params[j] for j in present], [cast(Tensor, grads[j]) for j in present]
        if any(_lists.column(gs, "is_sparse")) or _lists.column(gs, "shape") != _lists.column(
            ps, "shape"
        ):
            for j in present:
                g = cast(Tensor, grads[j])
                if g.is_sparse or g.shape != params[j].shape:
                    self._check_grad(index, j, params[j], g)
        need = []
        if not layout.full_states.holds(self.state, present):
            need = [
                j
                for j in present
                if len(self.state.get(params[j], ())) != len(layout.param_template[j])
            ]
        if need:
            try:
                self._init_param_states(layout, params, need)
            except BaseException:
                self._drop_param_states(params, need)
                raise
        layout.full_states.forget()
        try:
            self._update_group(layout, group, params, grads)
        except BaseException:
            if need:  # the state created for this step: as it was, none
                self._drop_param_states(params, need)
            raise
        layout.full_states.record(self.state, present)

    def _drop_param_states(self, params: list[Tensor], need: list[int]) -> None:
        for j in need:
            self.state.pop(params[j], None)

    def _update_group(
        self,
        layout: _Layout,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor | None],
        usual: list[dict[str, Tensor]] | None = None,
    ) -> None:
        """The group's update; ``usual``: the params' state dicts of a usual engine step
        (:meth:`PackedGroup.usual_grads`), which then skips the engine's checks."""
        for option, arg in layout.numeric.items():
            layout.hyper[arg].fill_(group[option])
        group_state = self._group_state_in(group, layout)
        engine = (
            layout.engine if usual is not None else self._engine(layout, params, grads, group_state)
        )
        if engine is not None:
            self._engine_update(layout, group, params, grads, engine, group_state, usual)  # type: ignore[arg-type]
            return
        if self.upcast_16bit_grads:  # (the engine converts them as it reads them)
            grads = [g.float() if g is not None and g.dtype in LOW_PRECISION else g for g in grads]
        outer = _outer_state(
            layout,
            group_state,
            lambda name: ParamSlots(_entry(self.state.get(p), name) for p in params),
        )
        state = optree.tree_unflatten(layout.spec, outer)
        # The optimizer owns the state, so it is donated (moments update in their own buffers);
        # the gradients are the user's, so they are not ("state": never written). A transform
        # of the user's that takes no ``donate`` keyword is called without it.
        accepted = extra_keywords(layout.tx)
        donation = {DONATE: "state"} if accepted is None or DONATE in accepted else {}
        updates, new_state = layout.tx.update(
            ParamSlots(grads), state, ParamSlots(params), **donation
        )

        new_outer, spec = _flatten_outer(new_state)
        if spec != layout.spec:
            raise RuntimeError(
                f"the transform changed its state structure: {layout.spec} -> {spec}"
            )
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for slot, old, new in zip(layout.slots, outer, new_outer, strict=True):
            if slot.kind == "param":
                for j, (o, n) in enumerate(zip(old, new, strict=True)):
                    if n is o:
                        continue
                    if o is None or n is None:
                        raise RuntimeError(
                            f"the transform created or dropped state {slot.name} of parameter {j}"
                        )
                    dst.append(o)
                    src.append(n)
            elif slot.kind == "group" and new is not old:
                dst.append(old)
                src.append(new)
        _copy_state(dst, src)
        new_updates = tree.leaves(updates)
        present = [(p, u) for p, u in zip(params, new_updates, strict=True) if u is not None]
        if present:
            ps, us = _local_pairs([p for p, _ in present], [u for _, u in present])
            ratio = 1.0 if self._base_lr is None else group["lr"] / self._base_lr
            if isinstance(ratio, Tensor):  # a tensor lr: no host read
                torch._foreach_add_(ps, [u * ratio.to(u.device) for u in us])
            elif ratio == 1.0:
                torch._foreach_add_(ps, us)
            else:
                torch._foreach_add_(ps, us, alpha=ratio)
        self._group_state_out(group, layout)

    def _engine(
        self,
        layout: _Layout,
        params: list[Tensor],
        grads: list[Tensor | None],
        group_state: Mapping[str, Tensor],
    ) -> PackedGroup | LabelParts | None:
        """The group's :class:`PackedGroup` (or :class:`LabelParts`: see
        :mod:`functional_opt.adapters.label_parts`) when this step can run on it, else ``None``. A
        group of ``DTensor`` params (FSDP2, HSDP) runs on it over its local shards. Every check
        gives the same answer on every rank (whole sizes, types, placements), so the ranks
        take the same path and issue the same collectives."""
        if not self.fused_steps or layout.engine is False:
            return None
        if layout.engine is None and sum(p.numel() for p in params) < self.fused_min_numel:
            return None
        if isinstance(layout.engine, LabelParts):
            ready = layout.engine.packable(layout.tx, params, grads, layout.template_shapes)
            return layout.engine if ready else None
        shards = None
        if not packable(layout.tx, params, grads, layout.template_shapes):
            shards = shards_of(layout.tx, params, grads, layout.param_template)
            if shards is None:
                if layout.engine is None and not fusable(layout.tx) and has_leaf_labels(layout.tx):
                    # (partition, a stateful masked: fusable over parts of one label each)
                    layout.engine = self._label_parts(layout, params, group_state) or False
                    return self._engine(layout, params, grads, group_state)
                return None
        if layout.engine is None:
            try:
                templates = templates_by_name(layout.param_template)
                slots = [(slot.kind, slot.name) for slot in layout.slots]
                if shards is None:
                    layout.engine = self._packed_group(layout, params, templates, slots)
                else:
                    outer = _outer_state(layout, group_state, lambda name: None)
                    given = [x for x, (kind, _) in zip(outer, slots, strict=True) if kind in GIVEN]
                    layout.engine = PackedGroup(
                        shards.locals,
                        templates,
                        layout.tx,
                        ParamSlots,
                        layout.spec,
                        slots,
                        params,
                        shards.group,
                        direct_min=self.direct_min_numel,
                        given=given,
                        direct_rest_max=self.direct_rest_max,
                        upcast=self.upcast_16bit_grads,
                    )
            except NotPackable:
                layout.engine = False
                return None
        engine: PackedGroup = layout.engine
        if engine.sharded != (shards is not None):
            return None
        return engine

    def _packed_group(
        self,
        layout: _Layout,
        params: list[Tensor],
        templates: dict[str, list[Tensor]],
        slots: list[tuple[str, str]],
        labels: list[Stages] | None = None,
    ) -> PackedGroup:
        """A :class:`PackedGroup` of plain ``params`` with this optimizer's options."""
        return PackedGroup(
            params,
            templates,
            layout.tx,
            ParamSlots,
            layout.spec,
            slots,
            direct_min=self.direct_min_numel,
            direct_rest_max=self.direct_rest_max,
            upcast=self.upcast_16bit_grads,
            labels=labels,
        )

    def _label_parts(
        self, layout: _Layout, params: list[Tensor], group_state: Mapping[str, Tensor]
    ) -> LabelParts | None:
        """The group as parts of one label each (see
        :mod:`functional_opt.adapters.label_parts`), or ``None``: plain tensors only (a group of
        ``DTensor``s is not split)."""
        if any(type(p) not in _lists._PLAIN for p in params):
            return None
        slots = [(slot.kind, slot.name) for slot in layout.slots]

        def make(
            mine: list[Tensor],
            templates: dict[str, list[Tensor]],
            part_slots: list[tuple[str, str]],
            labels: list[Stages],
        ) -> PackedGroup:
            return self._packed_group(layout, mine, templates, part_slots, labels)

        try:
            return label_parts(
                layout.tx,
                params,
                layout.param_template,
                layout.spec,
                slots,
                _outer_state(layout, group_state, lambda name: None),
                ParamSlots,
                make,
            )
        except NotPackable:
            return None

    def _engine_update(
        self,
        layout: _Layout,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        engine: PackedGroup | LabelParts,
        group_state: dict[str, Tensor],
        entries: list[dict[str, Tensor]] | None = None,
    ) -> None:
        ratio = 1.0 if self._base_lr is None else group["lr"] / self._base_lr
        if isinstance(engine, LabelParts):
            if entries is None:  # (a param of a label that keeps no state gets no entry)
                entries = [self.state.get(p, {}) for p in params]
            # each part's counters are its own; those every part advances (the same way), as
            # they were before the step for each part (see label_parts)
            shared = [group_state[layout.slots[j].name] for j in engine.shared]
            before = [t.clone() for t in shared]
            if engine.orphans is not None:  # (the counters of masks no param is in)
                with pinned(engine.orphans):
                    self._update_no_param(layout, group_state)
            for k, part in enumerate(engine.parts):
                if shared and (k > 0 or engine.orphans is not None):
                    torch._foreach_copy_(shared, before)
                with pinned(part.stages):
                    self._packed_update(
                        layout,
                        part.slots,
                        [params[i] for i in part.members],
                        [grads[i] for i in part.members],
                        part.group,
                        group_state,
                        [entries[i] for i in part.members],
                        ratio,
                    )
            self._group_state_out(group, layout)
            return
        # a usual step's params are where the last step left them (checked): kept for the next
        addresses = engine.usual[0] if entries is not None and engine.usual is not None else None
        engine.usual = None  # (until this step ends well)
        if entries is None:  # not a usual step (what usual_grads found holds for those only)
            engine.contiguous = None
            entries = list(map(self.state.__getitem__, params))
        slots = [(slot.kind, slot.name) for slot in layout.slots]
        self._packed_update(layout, slots, params, grads, engine, group_state, entries, ratio)
        self._group_state_out(group, layout)
        if not engine.sharded:
            engine.accept(params, entries, addresses, self.state)

    def _update_no_param(self, layout: _Layout, group_state: dict[str, Tensor]) -> None:
        """The transform's update of no param: the group-level state it changes."""
        none = ParamSlots(())
        outer = _outer_state(layout, group_state, lambda name: none)
        _, new_state = layout.tx.update(none, optree.tree_unflatten(layout.spec, outer), none)
        new_outer, _ = _flatten_outer(new_state)
        changed = [
            (old, new)
            for slot, old, new in zip(layout.slots, outer, new_outer, strict=True)
            if slot.kind == "group" and new is not old
        ]
        _copy_state([old for old, _ in changed], [new for _, new in changed])

    def _packed_update(
        self,
        layout: _Layout,
        slots: list[tuple[str, str]],
        params: list[Tensor],
        grads: list[Tensor],
        engine: PackedGroup,
        group_state: dict[str, Tensor],
        entries: list[dict[str, Tensor]],
        ratio: float | Tensor,
    ) -> None:
        """One :class:`PackedGroup`'s step (the group's, or a part's: ``slots`` are its own);
        the group-level state it changes is copied into ``group_state``."""
        engine.adopt_state(entries)
        outer = _outer_state(
            layout,
            group_state,
            lambda name: engine.packed_state(name) if name in engine.state else None,
        )
        new_state = engine.step(params, grads, outer, ratio)
        new_outer, spec = flatten_to_packed(new_state, ParamSlots)
        if spec != layout.spec:
            raise RuntimeError(
                f"the transform changed its state structure: {layout.spec} -> {spec}"
            )
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for (kind, name), old, new in zip(slots, outer, new_outer, strict=True):
            if kind == "param" and new is not old:
                engine.write_back(name, new)
            elif kind == "group" and new is not old:
                dst.append(old)
                src.append(new)
        _copy_state(dst, src)

    def forget_param_norms(self) -> None:
        """Make the next step take every param's norm from the param itself. A sharded step
        (FSDP2, HSDP) of a transform that clips by param norms (DreamerV3's) reuses each large
        local shard's ``||p||^2`` from its last update while the version counters of the shard
        and its ``DTensor`` say nothing wrote the param since; a write through ``p.data`` moves
        no version counter: call this after one (see ``docs/distributed.md``). Params that are
        not sharded never have their norms kept."""
        for layout in self._layouts:
            engine = None if layout is None else layout.engine
            if isinstance(engine, PackedGroup):
                engine.param_squares.clear()

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``, holding tensors and plain data only: a group option that is
        not plain data (a function, e.g. a ``mask``, or another object) is left out, as it cannot
        be loaded with ``torch.load(weights_only=True)``; :meth:`load_state_dict` takes it from
        this optimizer's groups, i.e. from the code that built the optimizer."""
        with _hooks_held(self, "_optimizer_state_dict_post_hooks") as post_hooks:
            sd = super().state_dict()  # runs the pre hooks
        sd["param_groups"] = [
            {k: v for k, v in group.items() if k == "params" or _is_plain(v)}
            for group in sd["param_groups"]
        ]
        for hook in post_hooks:  # they see what is saved
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint in torch's layout (see the module docstring).

        Everything is checked against this optimizer's transforms before anything changes; the
        state tensors are copied (never aliased) and keep the transform's dtypes (e.g. float32
        moments of bfloat16 params), not torch's default cast to the param's dtype. Options the
        checkpoint leaves out because they are not plain data (see :meth:`state_dict`) keep this
        optimizer's values. Load-state-dict pre hooks run first (they may adapt the checkpoint,
        which is then checked), post hooks once everything is loaded.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"an optimizer state dict is a dict, got {type(state_dict).__name__}")
        state_dict = state_dict.copy()
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError("an optimizer state dict has 'state' and 'param_groups' entries")
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if (
            not isinstance(saved_groups, (list, tuple))
            or not isinstance(saved_state, dict)
            or len(saved_groups) != len(self.param_groups)
            or any(
                not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups, strict=True)
            )
        ):
            raise ValueError("loaded state dict does not match the optimizer's param groups")
        originals: dict[Tensor, Mapping[str, Tensor]] = {}
        candidates = []
        kept: list[dict[str, Any]] = []  # per group: options taken from this optimizer
        options = set(self._option_args) | ({"lr"} if self._factory is None else set())
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            keep = {
                k: group[k]
                for k in options - set(saved)
                if k in group and (not _is_plain(group[k]) or self._factory is None)
            }
            missing = sorted(options - set(saved) - set(keep))
            if missing:
                raise ValueError(f"a loaded param group lacks the options {missing}")
            kept.append(keep)
            candidate = {**keep, **saved, "params": group["params"]}
            layout = self._build_layout(candidate)
            for pid, p in zip(saved["params"], group["params"], strict=True):
                originals[p] = saved_state.get(pid, {})
            self._check_param_states(layout, originals)
            self._init_group_state(dict(candidate), layout, existing=True)
            candidates.append(layout)
        with (
            _hooks_held(self, "_optimizer_load_state_dict_pre_hooks"),  # they ran above
            _hooks_held(self, "_optimizer_load_state_dict_post_hooks") as post_hooks,
        ):
            super().load_state_dict(state_dict)
        self._layouts = []
        for layout, group, keep in zip(candidates, self.param_groups, kept, strict=True):
            for key, value in keep.items():
                group.setdefault(key, value)
            layout.group = group
            self._init_group_state(group, layout, existing=True)
            for j, p in enumerate(group["params"]):
                loaded = self.state.pop(p, {})
                template = layout.param_template[j]
                entries = {}
                for name, value in loaded.items():
                    original = originals[p].get(name)
                    ref = template[name]
                    if value.dtype != ref.dtype and original is not None:
                        value = original  # torch cast it to the param's dtype: undo
                    entries[name] = value.to(device=p.device, dtype=ref.dtype, copy=True)
                if entries:
                    self.state[p] = entries
            self._layouts.append(layout)
        for post_hook in post_hooks:
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(
            _factory=self._factory,
            _transform=self._transform,
            _option_args=self._option_args,
            _base_lr=self._base_lr,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_base_lr", None)
        self._layouts = []

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for key in sorted(group):
                if key not in ("params", GROUP_STATE_KEY):
                    lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)


@contextlib.contextmanager
def _hooks_held(optimizer: torch.optim.Optimizer, name: str) -> Iterator[list[Callable[..., Any]]]:
    """Within the block, ``optimizer``'s hooks in the dict attribute ``name`` are held back
    (torch's own method does not run them); yields them, to be run by the caller."""
    hooks = getattr(optimizer, name)
    held = list(hooks.values())
    saved = hooks.copy()
    hooks.clear()
    try:
        yield held
    finally:
        hooks.update(saved)


def _local_pairs(dst: list[Tensor], src: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """``dst`` and ``src`` for an in-place multi-tensor op ``d <- f(d, s)``, with each ``DTensor``
    pair as its local shards (``src`` redistributed to ``dst``'s placements first where they
    differ): ``torch._foreach_copy_`` has no ``DTensor`` rule, and the local op skips the
    ``DTensor`` dispatch. Plain tensors pass through. Call under ``torch.no_grad()`` (then
    ``to_local()`` is the shard itself, so writing it writes the ``DTensor``)."""
    dtensor = _lists.dtensor_type()
    if dtensor is None:
        return dst, src
    out_dst: list[Tensor] = []
    out_src: list[Tensor] = []
    for d, s in zip(dst, src, strict=True):
        if isinstance(d, dtensor) and isinstance(s, dtensor):
            mesh, placements = d.device_mesh, d.placements  # type: ignore[attr-defined]
            if s.device_mesh != mesh or s.placements != placements:  # type: ignore[attr-defined]
                s = s.redistribute(mesh, placements)  # type: ignore[attr-defined]
            d, s = d.to_local(), s.to_local()  # type: ignore[attr-defined]
        out_dst.append(d)
        out_src.append(s)
    return out_dst, out_src


def _outer_state(
    layout: _Layout, group_state: Mapping[str, Tensor], per_param: Callable[[str], Any]
) -> list[Any]:
    """The leaves of a group's state tree (flattened down to its per-parameter nodes):
    ``per_param(name)`` for each per-parameter entry, the injected hyperparameters and the
    group-level tensors."""
    outer: list[Any] = []
    for slot in layout.slots:
        if slot.kind == "param":
            outer.append(per_param(slot.name))
        elif slot.kind == "hyper":
            outer.append(layout.hyper[slot.name])
        elif slot.kind == "group":
            outer.append(group_state[slot.name])
        else:
            outer.append(None)
    return outer


def _copy_state(dst: list[Tensor], src: list[Tensor]) -> None:
    """``d <- s`` for each pair (a source that is also a destination copied first), on local
    shards for ``DTensor``s."""
    if dst:
        if torch.compiler.is_compiling():  # (dynamo makes each id() a guard on its tensor)
            dsts = set(dst)
            src = [s.clone() if s in dsts else s for s in src]
        else:
            dst_ids = {id(t) for t in dst}
            src = [s.clone() if id(s) in dst_ids else s for s in src]
        torch._foreach_copy_(*_local_pairs(dst, src))


def _entry(entries: Mapping[str, Tensor] | None, name: str) -> Tensor | None:
    return entries.get(name) if entries else None


def _checked(
    stored: dict[str, Any], template: Mapping[str, Tensor], what: str
) -> dict[str, Tensor]:
    """``stored`` with the template's names, shapes, dtypes and devices (a copy where it had to
    change); raises ``ValueError`` naming the first mismatch."""
    missing = sorted(set(template) - set(stored))
    extra = sorted(set(stored) - set(template))
    if missing or extra:
        raise ValueError(f"{what}: missing {missing}, unexpected {extra}")
    out = {}
    for name, ref in template.items():
        value = stored[name]
        if not isinstance(value, Tensor):
            raise ValueError(f"{what}: {name} is a {type(value).__name__}, not a tensor")
        if value.shape != ref.shape:
            raise ValueError(
                f"{what}: {name} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}"
            )
        if ref.device.type == "meta":
            out[name] = value
        else:
            out[name] = value.to(device=ref.device, dtype=ref.dtype)
    return out
