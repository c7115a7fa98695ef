"""Base types: :class:`GradientTransformation`, :class:`EmptyState`, ``chain`` and friends."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.packed import Packed
from functional_opt.tree import PyTree

__all__ = [
    "DONATE",
    "EXTRA_KEYWORDS",
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "StepSize",
    "UnknownStepSize",
    "Params",
    "Schedule",
    "UpdateFn",
    "Updates",
    "apply_updates",
    "accepting",
    "chain",
    "check_extra",
    "current_stage",
    "declare_fusable",
    "declare_leaf_labels",
    "declare_leafwise",
    "declare_member_labels",
    "declare_stages",
    "declare_step_size",
    "declare_zero_updates",
    "describe",
    "donate_mode",
    "donating",
    "donating_updates",
    "expect_state",
    "extra_keywords",
    "fusable",
    "has_leaf_labels",
    "identity",
    "leaf_labels",
    "leafwise",
    "leafwise_level",
    "named_chain",
    "part_labels",
    "pinned",
    "safe_increment",
    "staged",
    "stages",
    "state_donation",
    "stateless",
    "stateless_with_tree_map",
    "step_size",
    "without_donation",
    "zero_count",
    "zero_updates",
]

Params = PyTree
Updates = PyTree
OptState = Any
Schedule = Callable[[Tensor], Tensor]
"""A schedule maps an integer step-count tensor to a 0-d value tensor."""

COUNT_DTYPE = torch.int32


class InitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer piece: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, new_state)``."""

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def zero_count() -> Tensor:
    """A fresh step counter: a 0-d int32 tensor holding 0."""
    return torch.zeros((), dtype=COUNT_DTYPE)


def safe_increment(count: Tensor) -> Tensor:
    """``count + 1``, saturating at the dtype's maximum instead of wrapping."""
    top = torch.iinfo(count.dtype).max
    return torch.where(count < top, count + 1, count)


DONATE = "donate"
"""The keyword of donation mode. ``tx.update(updates, state, params, donate=True)`` promises
that the caller never uses ``state`` or ``updates`` again, so transforms may write the new state
into the state's buffers and the new updates into the incoming updates' buffers (as JAX's
``donate_argnums``); ``donate="state"`` promises it for ``state`` only. Results are identical
either way."""

STATE_ONLY = "state"


EXTRA_KEYWORDS: frozenset[str] = frozenset({DONATE})
"""The extra keywords of ``update`` that the library's transforms accept (``donate``)."""

_ACCEPTS = "__functional_opt_extra_keywords__"


def check_extra(
    extra: dict[str, Any], where: str, accepted: frozenset[str] | None = EXTRA_KEYWORDS
) -> None:
    """Raises ``TypeError`` naming the keywords of ``extra`` that are not in ``accepted``
    (``None``: any keyword is accepted).

    Unknown keywords are an error, never silently ignored (a caller passing ``inplace=True``
    must not believe the update happened in place). The rule:

    * every transform of the library accepts the keywords in :data:`EXTRA_KEYWORDS` and checks
      them itself: its ``update`` calls this function, or :func:`donating`/
      :func:`donating_updates`, which check what they read;
    * the library's combinators (``chain``, ``named_chain``, ``masked``, ``partition``) accept
      the union of what their members accept, raise on a keyword that no member accepts, and
      pass each member only the keywords it accepts;
    * what a transform accepts is what it declared with :func:`accepting`; else, for a
      transform of this library, :data:`EXTRA_KEYWORDS`; else (a user's transform) what its
      ``update``'s signature names, or any keyword if it takes ``**kwargs`` (it then checks its
      own). So a user's transform that takes its own keywords (``update(..., rng=None,
      **extra)``) gets them inside a ``chain``, while the library's transforms next to it never
      see them. (The library's other wrappers, ``apply_if_finite``, ``MultiSteps`` and
      ``inject_hyperparams``, accept the library's keywords only unless they declare more with
      :func:`accepting`: a user's keyword through them is refused, never lost.)

    The check is a set comparison of the keywords, once per call: no per-leaf work."""
    if accepted is None or not extra or extra.keys() <= accepted:
        return
    unknown = sorted(set(extra) - accepted)
    what = (
        f"an unexpected keyword argument {unknown[0]!r}"
        if len(unknown) == 1
        else f"unexpected keyword arguments {', '.join(map(repr, unknown))}"
    )
    known = ", ".join(map(repr, sorted(accepted))) or "none"
    raise TypeError(f"{where + ': ' if where else ''}update() got {what} (accepted: {known})")


def accepting(update: Callable[..., Any], keywords: frozenset[str] | None) -> Callable[..., Any]:
    """Declares the extra keywords ``update`` accepts (``None``: any) for :func:`check_extra`'s
    rule; returns ``update``."""
    setattr(update, _ACCEPTS, keywords)
    return update


def extra_keywords(tx: GradientTransformation) -> frozenset[str] | None:
    """The extra keywords ``tx.update`` accepts (``None``: any), by :func:`check_extra`'s
    rule."""
    fn = tx.update
    declared: object = getattr(fn, _ACCEPTS, _UNDECLARED)
    if declared is None or isinstance(declared, frozenset):
        return declared
    if str(getattr(fn, "__module__", None)).startswith("functional_opt."):
        return EXTRA_KEYWORDS
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to read: let it check its own keywords
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [p for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    # updates, state and params come first (positionally): the others are extra keywords
    leading = 0
    while leading < min(3, len(rest)) and rest[leading].kind in positional:
        leading += 1
    return frozenset(
        p.name for p in rest[leading:] if p.kind is not inspect.Parameter.POSITIONAL_ONLY
    )


_UNDECLARED = object()


def _union(accepts: list[frozenset[str] | None]) -> frozenset[str] | None:
    if any(a is None for a in accepts):
        return None
    return frozenset().union(*accepts)  # type: ignore[arg-type]


def _for_member(extra: dict[str, Any], accepted: frozenset[str] | None) -> dict[str, Any]:
    """The keywords of ``extra`` a member that accepts ``accepted`` gets."""
    if accepted is None or extra.keys() <= accepted:
        return extra
    return {k: v for k, v in extra.items() if k in accepted}


def _flag(extra: dict[str, Any], accepted: frozenset[str] | None = None) -> bool | str:
    if accepted is not None and not extra.keys() <= accepted:
        check_extra(extra, "", accepted)
    flag = extra.get(DONATE, False)
    if not (isinstance(flag, bool) or flag == STATE_ONLY):
        raise TypeError(f"{DONATE}= must be a Python bool or {STATE_ONLY!r}, got {flag!r}")
    return flag  # type: ignore[no-any-return]


def donate_mode(extra: dict[str, Any]) -> bool | str:
    """An update's donation mode: ``True``, ``False`` or ``"state"`` (checked as
    :func:`donating` checks it)."""
    return _flag(extra, EXTRA_KEYWORDS)


def donating(extra: dict[str, Any], accepted: frozenset[str] | None = EXTRA_KEYWORDS) -> bool:
    """Whether an update's extra arguments donate the state (``donate=True`` or ``"state"``).

    Reading the extra arguments checks them: a keyword outside ``accepted`` (``None``: any) is
    a ``TypeError`` (see :func:`check_extra`)."""
    return bool(_flag(extra, accepted))


def donating_updates(
    extra: dict[str, Any], accepted: frozenset[str] | None = EXTRA_KEYWORDS
) -> bool:
    """Whether an update's extra arguments also donate the incoming updates (``donate=True``);
    checks them as :func:`donating` does."""
    return _flag(extra, accepted) is True


def without_donation(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` minus the donation flag: for a wrapper that may still need the old state."""
    return {k: v for k, v in extra.items() if k != DONATE}


def state_donation(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with at most the state donated: for passing updates the caller did not donate
    (made by another transform, which may still own them) to an inner transform."""
    return {**extra, DONATE: STATE_ONLY} if _flag(extra) else extra


class StepSize(NamedTuple):
    """What a transform declares about the size of its updates (see :func:`step_size`)."""

    factor: float
    """Every update is ``factor`` times a quantity that does not depend on ``factor`` (for
    ``adam(lr)``: ``-lr``)."""
    whole: bool
    """The transform is nothing but that factor (``scale``): the factor of the stage before it
    multiplies in."""


class UnknownStepSize(ValueError):
    """A transform's step size cannot be told from its declarations; the message says why."""


_STEP_SIZE = "__functional_opt_step_size__"


def declare_step_size(
    update: Callable[..., Any], declared: Callable[[], StepSize]
) -> Callable[..., Any]:
    """Declares how ``update`` scales its updates: ``declared()`` returns its
    :class:`StepSize` (or raises :class:`UnknownStepSize` saying why there is none); returns
    ``update``. Each construct of the library declares its own: ``scale`` its constant, ``chain``
    what its last members multiply to, wrappers whose updates are their inner transform's
    (``apply_if_finite``, ``MultiSteps``, ``named_chain``) the inner one's, ``dreamerv3`` its
    ``-lr`` (warm-up and decay are factors on top)."""
    setattr(update, _STEP_SIZE, declared)
    return update


def step_size(tx: GradientTransformation) -> StepSize:
    """The :class:`StepSize` that ``tx`` declares, e.g. ``StepSize(-1e-3, False)`` for
    ``chain(clip_by_global_norm(1.0), adam(1e-3))``: what lets ``TransformOptimizer`` drive a
    ready-made transform with ``group["lr"]``. Raises :class:`UnknownStepSize` when ``tx``
    (or its last stage) declares none: a transform of your own, ``masked``/``partition``, a
    schedule built into the transform."""
    declared = getattr(tx.update, _STEP_SIZE, None)
    if declared is None:
        fn = tx.update
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise UnknownStepSize(f"its last stage ({name}) declares no constant step size")
    out: StepSize = declared()
    return out


def constant_step_size(value: float | Tensor, what: str) -> StepSize:
    """A whole :class:`StepSize` of a constant (a Python number or a real 0-d tensor)."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_complex():
            raise UnknownStepSize(f"{what} is not a real 0-d tensor")
        return StepSize(float(value.detach().to(device="cpu", dtype=torch.float64)), True)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnknownStepSize(f"{what} is a {type(value).__name__}")
    return StepSize(float(value), True)


def inner_step_size(inner: GradientTransformation) -> Callable[[], StepSize]:
    """The declaration of a wrapper whose updates are ``inner``'s (or zero): ``inner``'s
    factor, not whole."""
    return lambda: StepSize(step_size(inner).factor, False)


def _chain_step_size(transforms: tuple[GradientTransformation, ...]) -> StepSize:
    """The product of the factors of a chain's last members, back to the first that is not
    a bare factor; whole when every member is one."""
    total, found = 1.0, False
    for member in reversed(transforms):
        try:
            factor, whole = step_size(member)
        except UnknownStepSize:
            if found:
                return StepSize(total, False)
            raise
        total, found = total * factor, True
        if not whole:
            return StepSize(total, False)
    if not found:
        raise UnknownStepSize("it is an empty chain")
    return StepSize(total, True)


_FUSABLE = "__functional_opt_fusable__"


def declare_fusable(
    update: Callable[..., Any], declared: bool | Callable[[], bool] = True
) -> Callable[..., Any]:
    """Declares that ``update`` does its math through ``tree.split(updates, elementwise=True)``
    and the list helpers (``declared()``: whether it does, for a wrapper that depends on its
    members), so the engine (:mod:`functional_opt.engine`) may compile it over packed buffers;
    returns ``update``."""
    setattr(update, _FUSABLE, declared if callable(declared) else (lambda: declared))
    return update


def fusable(tx: GradientTransformation) -> bool:
    """Whether ``tx`` declares that its math is elementwise over packed buffers (see
    :func:`declare_fusable`): the library's elementwise transforms, and chains and wrappers
    made only of them. A transform that declares nothing is not."""
    declared = getattr(tx.update, _FUSABLE, None)
    return bool(declared is not None and declared())


_LEAFWISE = "__functional_opt_leafwise__"


def declare_leafwise(
    update: Callable[..., Any],
    declared: bool | Callable[[], bool | int] = True,
    *,
    reductions: bool = False,
) -> Callable[..., Any]:
    """Declares that ``update`` treats every leaf on its own: each leaf's update and new state
    depend only on that leaf's update, state and param and on the state that is not per
    parameter (counters, injected hyperparameters), which the update changes the same way
    whatever the leaves (``declared()``: whether it does, for a wrapper that depends on its
    members; it may return a :func:`leafwise_level`). Then the update of a one-leaf tree, leaf
    by leaf, equals the update of the whole tree, and ``TransformOptimizer``'s engine may step
    large params one at a time, in their own storage (see
    ``functional_opt.adapters.packed_group``). A mask given as a tree is not leafwise.

    ``reductions=True``: leafwise but for reductions over all leaves taken with the library's
    helpers (a global norm, a finite check: ``at.global_norm``, ``at.all_finite`` of
    ``tree.split``, or :mod:`functional_opt._lists`): given those reductions' totals over the
    whole tree (:class:`functional_opt._lists.Across`), each leaf's update is the whole tree's
    for that leaf. Returns ``update``."""
    if callable(declared):
        setattr(update, _LEAFWISE, declared)
    else:
        level = (_GIVEN_REDUCTIONS if reductions else _ALONE) if declared else 0
        setattr(update, _LEAFWISE, lambda: level)
    return update


_ALONE = 2
_GIVEN_REDUCTIONS = 1


def leafwise_level(tx: GradientTransformation) -> int:
    """How ``tx`` treats the leaves (see :func:`declare_leafwise`): 2, every leaf on its own;
    1, every leaf on its own given the totals of its reductions over all leaves; 0, neither
    (what a transform that declares nothing is). A wrapper's is its members' lowest."""
    declared = getattr(tx.update, _LEAFWISE, None)
    value = declared() if declared is not None else 0
    if value is True:
        return _ALONE
    return int(value) if value else 0


def leafwise(tx: GradientTransformation, reductions: bool = False) -> bool:
    """Whether ``tx`` declares that it treats every leaf on its own (see
    :func:`declare_leafwise`); with ``reductions=True``, also one that does given the totals
    of its reductions over all leaves. A transform that declares nothing is not."""
    return leafwise_level(tx) >= (_GIVEN_REDUCTIONS if reductions else _ALONE)


_LEAF_LABELS = "__functional_opt_leaf_labels__"


def declare_leaf_labels(
    update: Callable[..., Any], read: Callable[[Params], list[Stages] | None]
) -> Callable[..., Any]:
    """Declares that ``update`` treats every leaf on its own given one *label* per leaf that
    it reads off the whole tree (a mask given as a function of the params, or as a tree: a leaf
    alone cannot tell whether it is masked). ``read(params)`` returns, for each leaf of
    ``params`` in order, its labels as ``(key, value)`` pairs (``key`` an ``int`` the transform
    owns, ``value`` a hashable Python value), or ``None`` when it has none to give (then the
    transform is not leafwise for that tree). Returns ``update``.

    The engine steps a leaf alone (:func:`functional_opt.leaf_step.leaf_step`) under
    :func:`staged` with its labels added to the step's stages: the transform reads its value
    with :func:`current_stage` instead of looking at the tree, and one compiled step serves the
    leaves of each label. Its update of a part of the tree (the leaves the engine packs beside
    those it steps alone) runs under :func:`pinned` with, under each key, the tuple of the
    part's leaves' values, in order. A transform that declares labels must also declare itself
    leafwise (:func:`declare_leafwise`); a wrapper's labels are its members'
    (:func:`leaf_labels`)."""
    setattr(update, _LEAF_LABELS, read)
    return update


def leaf_labels(tx: GradientTransformation, params: Params) -> list[Stages] | None:
    """Each leaf's labels (see :func:`declare_leaf_labels`) for the tree ``params``: ``None`` for
    a transform that declares none (every leaf is treated alike), else one tuple of ``(key,
    value)`` pairs per leaf. Raises ``ValueError`` where a member has labels but cannot give
    them for this tree (the engine then does not step leaves alone)."""
    read = getattr(tx.update, _LEAF_LABELS, None)
    if read is None:
        return None
    out: list[Stages] | None = read(params)
    if out is None:
        raise ValueError("leaf_labels: the transform cannot label the leaves of this tree")
    return out


def has_leaf_labels(tx: GradientTransformation) -> bool:
    """Whether ``tx`` declares leaf labels (see :func:`declare_leaf_labels`)."""
    return getattr(tx.update, _LEAF_LABELS, None) is not None


def _joined_labels(
    transforms: Sequence[GradientTransformation], params: Params
) -> list[Stages] | None:
    """The members' labels of each leaf, one after the other (``None``: none declares any)."""
    found = [leaf_labels(t, params) for t in transforms]
    present = [f for f in found if f is not None]
    if not present:
        return None
    return [tuple(pair for member in present for pair in member[i]) for i in range(len(present[0]))]


def part_labels(labels: list[Stages], members: Sequence[int]) -> Stages:
    """The labels of the part ``members`` of a tree whose leaves have ``labels``: under each
    key, the tuple of the members' values in order (what :func:`pinned` takes)."""
    keys = [k for k, _ in labels[members[0]]] if members else []
    by_leaf = [dict(labels[i]) for i in members]
    return tuple((k, tuple(d[k] for d in by_leaf)) for k in keys)


def declare_member_labels(
    update: Callable[..., Any], members: Callable[[], Sequence[GradientTransformation]]
) -> Callable[..., Any]:
    """Declares a wrapper's or chain's leaf labels: those of ``members()`` (see
    :func:`declare_leaf_labels`), where any of them declares some."""
    if any(map(has_leaf_labels, members())):
        declare_leaf_labels(update, lambda params: _joined_labels(members(), params))
    return update


_STAGES = "__functional_opt_stages__"

Stages = tuple[tuple[int, Hashable], ...]
"""What :func:`stages` returns: ``(key, value)`` pairs, in a fixed order."""

_CURRENT: dict[int, Hashable] = {}  # the stages the engine traces under (see :func:`staged`)


def declare_stages(update: Callable[..., Any], read: Callable[[Any], Stages]) -> Callable[..., Any]:
    """Declares that the work of ``update`` depends on a value of its state that can be read in
    Python for free before a step (a counter on the CPU, in eager mode): ``read(state)`` returns
    ``(key, value)`` pairs, each ``key`` an ``int`` the transform owns (its ``id``) and each
    ``value`` a hashable Python value, or ``()`` when nothing can be read for free (an
    accelerator's counter, a traced or ``vmap``-wrapped one). Returns ``update``.

    The engine (:mod:`functional_opt.engine`) compiles one graph per stage: it calls
    :func:`stages` on the state before each step, keys its compiled graphs by the result, and
    traces and runs each under :func:`staged`, so the transform reads its value with
    :func:`current_stage` while being traced and compiles only the work of that stage
    (``MultiSteps``: the accumulation alone on a mini-step that emits nothing). Without a
    stage (plain ``torch.compile``, ``vmap``, an accelerator's counter) the transform must
    compute every outcome and select with ``torch.where``."""
    setattr(update, _STAGES, read)
    return update


def stages(tx: GradientTransformation, state: Any) -> Stages:
    """The stages ``tx`` declares for ``state`` (see :func:`declare_stages`): ``()`` for a
    transform that declares none, and always under ``torch.compile`` (nothing is read there)."""
    if torch.compiler.is_compiling():
        return ()
    read = getattr(tx.update, _STAGES, None)
    out: Stages = () if read is None else read(state)
    if _PINNED:  # (a member's stages are its chain's too: each pinned value once)
        out = tuple(p for p in out if p[0] not in _PINNED) + tuple(_PINNED.items())
    return out


_PINNED: dict[int, Hashable] = {}  # added to the stages found and set (see :func:`pinned`)


@contextlib.contextmanager
def pinned(values: Stages) -> Iterator[None]:
    """Adds ``values`` to the stages :func:`stages` finds and :func:`staged` sets inside (the
    engine's update of a part of a tree, given the labels of that part's leaves: see
    :func:`declare_leaf_labels`); restores the previous ones after."""
    saved = dict(_PINNED)
    _PINNED.update(values)
    try:
        yield
    finally:
        _PINNED.clear()
        _PINNED.update(saved)


@contextlib.contextmanager
def staged(values: Stages) -> Iterator[None]:
    """Makes ``values`` (from :func:`stages`) the current stages for the code run inside (the
    engine traces and calls a graph compiled for them under it); restores the previous ones
    after."""
    saved = dict(_CURRENT)
    _CURRENT.clear()
    _CURRENT.update(_PINNED)
    _CURRENT.update(values)
    try:
        yield
    finally:
        _CURRENT.clear()
        _CURRENT.update(saved)


def current_stage(key: int) -> Hashable | None:
    """The value the engine set for ``key`` with :func:`staged` (or, outside it, with
    :func:`pinned`), or ``None``. Read while ``torch.compile`` traces, it is a Python constant
    of the graph (guarded by dynamo)."""
    value = _CURRENT.get(key)
    if value is None:
        value = _PINNED.get(key)
    return value


_ZERO_UPDATES = "__functional_opt_zero_updates__"


def declare_zero_updates(
    update: Callable[..., Any], when: Callable[[Stages], bool]
) -> Callable[..., Any]:
    """Declares that in the stages for which ``when(stages)`` is true (``stages`` as
    :func:`stages` reads them before a step) ``update`` returns a negative zero for every
    element of every leaf, whatever its inputs: ``p + u`` is then ``p`` bit for bit, so the
    engine skips adding the update into the params (``MultiSteps``' mini-steps that only
    accumulate). Returns ``update``."""
    setattr(update, _ZERO_UPDATES, when)
    return update


def zero_updates(tx: GradientTransformation, found: Stages) -> bool:
    """Whether ``tx``'s update in the stages ``found`` is negative zeros throughout (see
    :func:`declare_zero_updates`); ``False`` for a transform that declares nothing."""
    when = getattr(tx.update, _ZERO_UPDATES, None)
    return bool(when is not None and found and when(found))


def _member_stages(transforms: tuple[GradientTransformation, ...], state: Any) -> Stages:
    if not isinstance(state, tuple) or len(state) != len(transforms):
        return ()  # (the update names the error)
    return tuple(item for t, s in zip(transforms, state, strict=True) for item in stages(t, s))


def describe(state: Any) -> str:
    """A short description of a state's kind for error messages, e.g. ``a tuple of 2 states``
    or ``a ScaleByAdamState``."""
    name = type(state).__name__
    if type(state) is tuple:
        return f"a tuple of {len(state)} states"
    return f"an {name}" if name[:1] in "AEIOU" else f"a {name}"


def expect_state(state: Any, kind: type | tuple[type, ...], where: str) -> None:
    """Raises ``TypeError`` unless ``state`` is a ``kind`` (e.g. another transform's state was
    passed): a cheap ``isinstance``, once per call."""
    if not isinstance(state, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise TypeError(
            f"{where} expects a state of type {' or '.join(k.__name__ for k in kinds)}, got "
            f"{describe(state)} (the state of another transform, or of another configuration "
            "of this one?)"
        )


def stateless(
    fn: Callable[[Updates, Params | None], Updates],
    name: str | None = None,
    *,
    elementwise: bool = False,
    leafwise: bool = False,
    reductions: bool = False,
) -> GradientTransformation:
    """A transform without state: ``update`` returns ``fn(updates, params)`` and the
    ``EmptyState`` it was given. Given ``params``, it refuses updates of another shape (naming
    the leaf), as every transform does. It accepts the library's extra keywords only
    (:func:`check_extra`); ``name`` (default: the function that made ``fn``) names it in
    errors. ``elementwise=True`` declares that ``fn`` splits its updates with
    ``tree.split(updates, elementwise=True)`` (see :func:`declare_fusable`); ``leafwise=True``
    that it maps each leaf on its own (see :func:`declare_leafwise`), with ``reductions=True``
    given the totals of its reductions over all leaves."""
    where = name or fn.__qualname__.split(".<locals>")[0]

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if extra:
            check_extra(extra, where)
            _flag(extra)
        if not (isinstance(state, tuple) and len(state) == 0):
            raise TypeError(
                f"{where} is stateless: its state is EmptyState(), got {describe(state)} (the "
                "state of another transform?)"
            )
        if params is not None:  # a gradient of another shape is refused, never passed on
            tree.split(updates, elementwise=True)[1].check(params, "params")
        return fn(updates, params), state

    declare_fusable(update_fn, elementwise)
    declare_leafwise(update_fn, leafwise, reductions=reductions)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


def stateless_with_tree_map(
    fn: Callable[[Tensor, Tensor | None], Tensor],
    name: str | None = None,
    *,
    elementwise: bool = False,
) -> GradientTransformation:
    """A stateless transform applying ``fn(u, p)`` to each update leaf ``u`` and its param
    ``p`` (``None`` when ``update`` gets no params); ``None`` updates stay ``None``. With
    ``elementwise=True`` (``fn`` computes each element from the elements at the same place)
    packed trees are mapped buffer by buffer and the engine may fuse it (see
    :func:`stateless`)."""
    where = name or getattr(fn, "__qualname__", "stateless_with_tree_map").split(".<locals>")[0]

    def apply(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            return tree.tree_map(lambda u: fn(u, None), updates, elementwise=elementwise)
        return tree.tree_map(fn, updates, params, elementwise=elementwise)

    return stateless(apply, where, elementwise=elementwise, leafwise=True)


def identity() -> GradientTransformation:
    """Leaves updates unchanged: ``u -> u``."""
    return stateless(lambda updates, params: updates, "identity", elementwise=True, leafwise=True)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transforms in order, ``u -> t_n(... t_1(u))``; the state is a tuple of theirs.

    Extra keywords of ``update`` go to the members that accept them; one that no member accepts
    is a ``TypeError`` (see :func:`check_extra`)."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation"
            )

    accepts = [extra_keywords(t) for t in transforms]
    accepted = _union(accepts)
    # whether every member takes the library's keywords (then they pass without filtering)
    plain = all(a is None or a >= EXTRA_KEYWORDS for a in accepts)

    def init_fn(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = describe(state)
            raise ValueError(
                f"chain of {len(transforms)} transforms: the state must be a tuple of "
                f"{len(transforms)} states (one per transform), got {got} at <root> (the state "
                "of another transform?)"
            )
        # Only the first transform gets the caller's updates; the others get updates made by
        # the transform before them, which may be that transform's state, so they may not
        # write into them.
        later = state_donation(extra)
        if extra and not (plain and extra.keys() <= EXTRA_KEYWORDS):
            check_extra(extra, "chain", accepted)
            firsts = [_for_member(extra, a) for a in accepts]
            laters = [_for_member(later, a) for a in accepts]
        else:
            firsts, laters = [extra] * len(transforms), [later] * len(transforms)
        new_states = []
        for i, (t, s) in enumerate(zip(transforms, state, strict=True)):
            updates, s = t.update(updates, s, params, **(firsts[i] if i == 0 else laters[i]))
            new_states.append(s)
        return updates, tuple(new_states)

    declare_step_size(update_fn, lambda: _chain_step_size(transforms))
    declare_fusable(update_fn, lambda: all(fusable(t) for t in transforms))
    declare_leafwise(update_fn, lambda: min((leafwise_level(t) for t in transforms), default=2))
    declare_member_labels(update_fn, lambda: transforms)
    if any(getattr(t.update, _STAGES, None) is not None for t in transforms):
        declare_stages(update_fn, lambda state: _member_stages(transforms, state))
    return GradientTransformation(init_fn, accepting(update_fn, accepted))


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by the given names."""
    names = [name for name, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    inner = chain(*(t for _, t in transforms))

    def init_fn(params: Params) -> dict[str, OptState]:
        return dict(zip(names, inner.init(params), strict=True))

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, dict) or list(state) != names:
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"named_chain expects a state dict with keys {names} at <root>, got {got}"
            )
        updates, states = inner.update(updates, tuple(state[n] for n in names), params, **extra)
        return updates, dict(zip(names, states, strict=True))

    declare_step_size(update_fn, inner_step_size(inner))
    declare_fusable(update_fn, lambda: fusable(inner))
    declare_leafwise(update_fn, lambda: leafwise_level(inner))
    declare_member_labels(update_fn, lambda: (inner,))
    if getattr(inner.update, _STAGES, None) is not None:
        declare_stages(
            update_fn,
            lambda state: (
                stages(inner, tuple(state[n] for n in names))
                if isinstance(state, dict) and list(state) == names
                else ()
            ),
        )
    return GradientTransformation(init_fn, accepting(update_fn, extra_keywords(inner)))


def apply_updates(params: Params, updates: Updates, *, donate: bool = False) -> Params:
    """``p + u`` leaf by leaf, cast back to each param's dtype; a ``None`` update keeps ``p``.

    ``donate=True`` promises that the caller never uses ``params`` again: the sums are then
    written into the params' buffers (same arithmetic, same result) where that is safe (plain
    tensors that autograd does not track).
    """
    if not isinstance(donate, bool):
        raise TypeError(f"donate= must be a Python bool, got {donate!r}")
    if isinstance(params, Packed) and isinstance(updates, Packed):
        packed = _apply_packed(params, updates, donate)
        if packed is not None:
            return packed
    pvals, spec = tree.flatten(params)
    where = tree.Leaves(pvals, spec, params, "params")
    uvals = where.flat(updates, "updates")
    idx = [
        i
        for i, (p, u) in enumerate(zip(pvals, uvals, strict=True))
        if p is not None and u is not None
    ]
    xs = [pvals[i] for i in idx]
    us = [uvals[i] for i in idx]
    dtypes = _check_updates(where, idx, xs, us)
    if donate and _in_place_ok(xs, us, dtypes):
        _add_in_place(xs, us, dtypes[0])
        return params
    new = _lists.like(_lists.add(xs, us), xs)
    out = list(pvals)
    for i, v in zip(idx, new, strict=True):
        out[i] = v
    return tree.unflatten(spec, out)


def _check_updates(
    where: tree.Leaves, idx: list[int], xs: list[Tensor], us: list[Tensor]
) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """Each update has its param's shape (nothing is broadcast), is floating point or complex,
    and is real where the param is real (a cast would drop the imaginary part): else a
    ``ValueError``/``TypeError`` naming the leaf. Lists of shapes and dtypes are compared (a
    Python comparison per leaf); no tensor is read. Returns the params' and the updates'
    dtypes (read once per step: over 2000 leaves each list costs as much as a small kernel)."""
    try:
        pshapes, ushapes = _lists.column(xs, "shape"), _lists.column(us, "shape")
    except AttributeError:
        for i, p, u in zip(idx, xs, us, strict=True):
            for what, x in (("param", p), ("update", u)):
                if not isinstance(x, Tensor):
                    raise TypeError(
                        f"apply_updates: the {what} at {where.path(i)} is a "
                        f"{type(x).__name__}, not a tensor"
                    ) from None
        raise
    if pshapes != ushapes:
        for i, ps, us_ in zip(idx, pshapes, ushapes, strict=True):
            if ps != us_:
                raise ValueError(
                    f"apply_updates: the update at {where.path(i)} has shape {tuple(us_)}, but "
                    f"the param has shape {tuple(ps)}: shapes must be equal (nothing is "
                    "broadcast)"
                )
    dtypes = (_lists.column(xs, "dtype"), _lists.column(us, "dtype"))
    if set(dtypes[1]) <= _FLOATS:
        return dtypes
    for i, p, u in zip(idx, xs, us, strict=True):
        if not (u.dtype.is_floating_point or u.dtype.is_complex):
            raise TypeError(
                f"apply_updates: the update at {where.path(i)} has dtype {u.dtype}: updates must "
                "be floating point or complex"
            )
        if u.dtype.is_complex and not p.dtype.is_complex:
            raise TypeError(
                f"apply_updates: the update at {where.path(i)} is complex ({u.dtype}) but the "
                f"param is real ({p.dtype}): the imaginary part would be lost"
            )
    return dtypes


_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _apply_packed(params: Packed, updates: Packed, donate: bool) -> Packed | None:
    """``apply_updates`` over the buffers of two packed trees of one layout (one add per
    buffer instead of one per leaf), or ``None`` when one of them is loose or the layouts
    differ (e.g. bfloat16 and float32 params in two buffers, their float32 updates in one).
    Elementwise the same adds as leaf by leaf."""
    p, u, layout = params.buffers, updates.buffers, params.layout
    if p is None or u is None or layout is None or layout != updates.layout:
        return None
    ps, us = list(p), list(u)
    if not set(_lists.column(us, "dtype")) <= _FLOATS:
        return None  # the leaf-by-leaf path names the leaf whose dtype is refused
    if donate and _in_place_ok(ps, us):
        _add_in_place(ps, us)
        return params
    return Packed(layout, buffers=_lists.like(_lists.add(ps, us), ps))


_NARROW = frozenset((torch.bfloat16, torch.float16))


def _add_in_place(
    xs: list[Tensor], us: list[Tensor], dtypes: list[torch.dtype] | None = None
) -> None:
    """``x += u`` for each pair: large 16-bit pairs of one dtype through a compiled kernel
    (eager 16-bit adds measured twice as slow; the sums are the same, rounded once from
    float32), the rest with one multi-tensor add. ``dtypes``: the ``xs``' dtypes, if known."""
    rest: list[int] | range = range(len(xs))
    if dtypes is None:
        dtypes = _lists.column(xs, "dtype")
    if not torch.compiler.is_compiling() and not _NARROW.isdisjoint(dtypes):
        narrow = [
            i
            for i, (x, u) in enumerate(zip(xs, us, strict=True))
            if x.dtype in _NARROW
            and u.dtype == x.dtype
            and x.numel() >= _kernels.ADD_MIN
            and x.is_contiguous()
            and u.is_contiguous()
        ]
        for i in narrow:
            _kernels.call(_kernels.add_in_place, xs[i].view(-1), us[i].view(-1))
        if narrow:
            taken = set(narrow)
            rest = [i for i in rest if i not in taken]
    if rest:
        torch._foreach_add_([xs[i] for i in rest], [us[i] for i in rest])


def _in_place_ok(
    xs: list[Tensor],
    us: list[Tensor],
    dtypes: tuple[list[torch.dtype], list[torch.dtype]] | None = None,
) -> bool:
    """Whether ``x += u`` may write each param. ``dtypes``: the params' and the updates' dtypes,
    given by a caller that has already found each update's shape equal to its param's."""
    if not (_lists.use_foreach(xs) and _lists.use_foreach(us)):
        return False
    if not _lists.distinct(xs):
        return False  # a param twice in the tree: each sum must see the old value
    if torch.is_grad_enabled() and _lists.tracked(xs, us):
        return False  # autograd may need the old values, and leaves refuse in-place ops
    if dtypes is None:
        if _lists.column(xs, "shape") != _lists.column(us, "shape"):
            return False
        dtypes = (_lists.column(xs, "dtype"), _lists.column(us, "dtype"))
    pdtypes, udtypes = dtypes
    return pdtypes == udtypes or all(
        p == torch.promote_types(p, u) for p, u in zip(pdtypes, udtypes, strict=True)
    )
