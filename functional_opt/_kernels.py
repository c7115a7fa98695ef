"""DreamerV3's elementwise update as single-pass kernels, compiled once with ``torch.compile``,
and the machinery that compiles the engine's per-leaf kernels (:class:`Kernel`).

One pass reads ``g, nu, mu`` (and ``p`` where the kernel applies the update) and writes the new
moments and the update: the clip factor, both bias corrections and the learning rate are folded
into per-tensor scalars, so there is one division per element and no temporaries. Used by
``DreamerV3Optimizer``'s flat buffers.

Every kernel is compiled with ``dynamic=True`` (one compilation serves every size) the first
time it runs with a given signature, then called without ``torch._dynamo``'s per-call work
(:class:`_Compiled`), and falls back to running eagerly, with a warning, if compilation fails.
Only a failure to compile falls back, and only before the compiled code ran: an error raised
while it runs (it may have written some of its outputs) surfaces as itself and the kernel stays
compiled; an error in the arguments (a bad shape) surfaces as the error eager code raises.
"""

from __future__ import annotations

import itertools
import operator
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor
from torch.utils import _python_dispatch

__all__ = [
    "ADD_MIN",
    "Kernel",
    "add_in_place",
    "apply_kernel",
    "call",
    "compiles_here",
    "compiled",
    "moments_math",
    "norm_pair",
    "update_kernel",
    "update_kernel_donated",
]


def moments_math(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
) -> tuple[Tensor, Tensor]:
    """``g' = factor g`` (rounded to ``g``'s dtype, as the chain's clip is);
    ``nu' = b2 nu + (1-b2) g'^2``; ``r = g' / (sqrt(nu' inv_bc2) + eps)``;
    ``mu' = b1 mu + (1-b1) r``. Returns ``(nu', mu')`` in the moments' dtype."""
    gs = (g.to(nu.dtype) * factor).to(g.dtype).to(nu.dtype)
    nu_new = beta2 * nu + (1 - beta2) * (gs * gs)
    r = gs / (torch.sqrt(nu_new * inv_bc2) + eps)
    mu_new = beta1 * mu + (1 - beta1) * r
    return nu_new, mu_new


def apply_kernel(
    g: Tensor,
    p: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
) -> None:
    """:func:`moments_math` written into ``nu`` and ``mu``, and ``p' = p + step_size mu'`` into
    ``p``, with ``inv_bc2 = 1/(1-b2^t)`` and ``step_size = -lr_t/(1-b1^t)``. ``factor`` and
    ``step_size`` broadcast (per row of 2-D views, or per element)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    p.copy_((p.to(mu.dtype) + mu_new * step_size).to(p.dtype))


def _update(
    g: Tensor, mu: Tensor, step_size: Tensor, p: Tensor | None, decay: Tensor | None
) -> Tensor:
    u = mu * step_size
    if p is not None and decay is not None:
        u = u + decay * p.to(mu.dtype)
    return u.to(g.dtype)


def update_kernel(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    p: Tensor | None = None,
    decay: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure: ``(nu', mu', u)`` with ``u = step_size mu' (+ decay p)`` in ``g``'s dtype (``decay``
    is ``-lr_t`` times the weight decay; without ``p`` there is none)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    return nu_new, mu_new, _update(g, mu_new, step_size, p, decay)


def update_kernel_donated(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    p: Tensor | None = None,
    decay: Tensor | None = None,
) -> Tensor:
    """:func:`update_kernel` with the new moments written into ``nu`` and ``mu``; returns ``u``
    (the same arithmetic, so the same bits)."""
    nu_new, mu_new, u = update_kernel(
        g, nu, mu, factor, step_size, inv_bc2, beta1, beta2, eps, p, decay
    )
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    return u


ADD_MIN = 1 << 14
"""16-bit tensors with at least this many elements take :func:`add_in_place` in eager
``apply_updates(..., donate=True)``."""


def add_in_place(p: Tensor, u: Tensor) -> None:
    """``p <- p + u``, summed in float32 and rounded once to ``p``'s dtype (as eager adds of
    16-bit tensors do)."""
    p.copy_((p.to(torch.float32) + u.to(torch.float32)).to(p.dtype))


def norm_pair(g: Tensor, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``[||g||, ||p||]`` accumulated in ``dtype`` (a cascade sum, without widened copies of
    16-bit inputs, and more accurate than ``torch.linalg.vector_norm``)."""
    g32, p32 = g.to(dtype), p.to(dtype)
    return torch.sqrt(torch.stack([(g32 * g32).sum(), (p32 * p32).sum()]))


_Key = tuple[Any, ...]
_COMPILED: dict[_Key, _Compiled] = {}
_FAILED: set[Callable[..., Any]] = set()


_TWO = itertools.repeat(2)


def _signature(fn: Callable[..., Any], args: tuple[Any, ...]) -> _Key:
    """``fn``, and per argument its dtype, device and sizes with those above 1 as 2 (what a
    graph compiled with dynamic sizes is specialized on), or the argument itself."""
    return (
        fn,
        *[
            (a.dtype, a.device, *map(min, a.shape, _TWO)) if isinstance(a, Tensor) else a
            for a in args
        ],
    )


class _Compiled:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=True)``, called directly once compiled.

    The first call goes through ``torch._dynamo``, which traces ``fn`` into one graph and hands
    it to inductor. Later calls skip dynamo's frame evaluation and guards (60-150 us per call,
    as much as a kernel over 100K elements costs) and call inductor's compiled graph with the
    arguments in the graph's order, sizes included (:class:`_Direct`). That is safe because each
    instance serves one signature (dtypes, devices, ranks, which sizes are 0 or 1: the things
    dynamo specializes a dynamic graph on), and the compiled graph still checks every input's
    sizes and strides before it runs (a mismatch goes back through dynamo). Calls that autograd
    would record, and every call of a signature that dynamo had to compile more than once,
    go through dynamo."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        # A code object of its own: compilations of other signatures never count against this
        # one's recompile limit (past it dynamo silently runs the function eagerly, with other
        # rounding).
        copy = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self._dynamo = torch.compile(copy, backend=self._backend, fullgraph=True, dynamic=True)
        self._graphs = 0
        self._capture: _Capture | None = None
        self.direct: _Direct | None = None
        self.started = False
        """Whether the last call reached the compiled code (so it may have written outputs):
        an error raised with ``started`` false came from tracing or compiling."""

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # torch.compile's own default backend, looked up by name
        inductor = torch._dynamo.lookup_backend("inductor")
        compiled = cast(Callable[..., Any], inductor(gm, example_inputs))
        self._graphs += 1
        self.direct = None
        if self._graphs > 1 or self._capture is None:
            self._capture = None

            def run(*inputs: Any) -> Any:
                self.started = True
                return compiled(*inputs)

            return run
        capture = self._capture
        capture.graph(gm, example_inputs)

        def first(*inputs: Any) -> Any:
            self.started = True
            out = compiled(*inputs)
            if capture.args is not None:  # the compiling call: see what the outputs are
                capture.outputs = out
            return out

        capture.compiled = compiled
        return first

    def __call__(self, *args: Any) -> Any:
        direct = self.direct
        if direct is not None and not _recorded(args):
            self.started = True
            try:
                return direct(args)
            except AssertionError:  # the graph's own size/stride check, before it ran
                self.direct = None
        self.started = False
        if self._graphs == 0 and not _recorded(args):
            self._capture = _Capture(args)
        try:
            # Python numbers (a transform's constants, even those its closures hold) stay
            # constants of the graph, as in a graph compiled with fixed sizes: traced as symbols
            # they would be inputs the direct call cannot give (and a check such as
            # math.isfinite(x) of one could not be traced). nn.Parameter arguments get dynamic
            # sizes like other tensors (by default dynamo fixes a parameter's sizes, which would
            # compile once per size).
            with torch._dynamo.config.patch(
                specialize_int=True, specialize_float=True, force_parameter_static_shapes=False
            ):
                result = self._dynamo(*args)
        finally:
            capture, self._capture = self._capture, None
        if capture is not None:
            if self._graphs == 1:
                self.direct = capture.direct(result)
            capture.release()
        return result


def _recorded(args: tuple[Any, ...]) -> bool:
    """Whether autograd would record a call with these arguments."""
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


OFFSET = -2
"""In :class:`_Direct`'s inputs: the argument's storage offset (a view into a larger buffer)."""


class _Direct(NamedTuple):
    """How to call a compiled graph without dynamo: which argument (or which size or storage
    offset of which argument) each graph input is, and how the outputs form the function's
    result."""

    compiled: Callable[..., Any]
    inputs: tuple[tuple[int, int], ...]  # (argument, -1), (argument, dim) or (argument, OFFSET)
    form: int  # -1: None; 0: one tensor; k > 0: a tuple of k tensors
    # Storage offsets dynamo gave one symbol: (where the graph input comes from, the arguments
    # whose offsets must equal it). The graph checks sizes and strides itself, not offsets.
    offsets: tuple[tuple[tuple[int, int], tuple[int, ...]], ...] = ()

    def __call__(self, args: tuple[Any, ...]) -> Any:
        for source, same in self.offsets:
            value = _value(args, source)
            if any(args[i].storage_offset() != value for i in same):
                raise AssertionError("storage offsets differ from the compiled graph's")
        out = self.compiled(*[_value(args, source) for source in self.inputs])
        if self.form < 0:
            return None
        return out[0] if self.form == 0 else tuple(out)


def _value(args: tuple[Any, ...], source: tuple[int, int]) -> Any:
    i, d = source
    if d == -1:
        return args[i]
    return args[i].storage_offset() if d == OFFSET else args[i].shape[d]


class _Capture:
    """What the compiling call shows of the graph, turned into a :class:`_Direct` if every
    graph input is an argument or one of its sizes and every output part of the result."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args: tuple[Any, ...] | None = args
        self.inputs: tuple[tuple[int, int], ...] | None = None
        self.offsets: tuple[tuple[tuple[int, int], tuple[int, ...]], ...] = ()
        self.compiled: Callable[..., Any] | None = None
        self.outputs: Any = None

    def release(self) -> None:
        """Drop the references to the compiling call's tensors."""
        self.args = self.outputs = None

    def graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
        args = self.args or ()
        tensors = [a for a in args if isinstance(a, Tensor)]
        if len({id(a) for a in tensors}) != len(tensors):
            return  # an argument passed twice is one graph input: later calls may differ
        where = {id(a): i for i, a in enumerate(args) if isinstance(a, Tensor)}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            return
        sizes: dict[Any, tuple[int, int]] = {}  # symbol -> (argument, dimension)
        offsets: dict[Any, list[int]] = {}  # symbol -> the arguments with it as storage offset
        for node, example in zip(placeholders, example_inputs, strict=True):
            fake = node.meta.get("example_value")
            if isinstance(example, Tensor) and id(example) in where and fake is not None:
                for d, n in enumerate(fake.shape):
                    if isinstance(n, torch.SymInt):
                        sizes.setdefault(n.node.expr, (where[id(example)], d))
                offset = fake.storage_offset()
                if isinstance(offset, torch.SymInt):
                    offsets.setdefault(offset.node.expr, []).append(where[id(example)])
        for symbol, users in offsets.items():
            sizes.setdefault(symbol, (users[0], OFFSET))
        inputs = []
        for example in example_inputs:
            if isinstance(example, Tensor) and id(example) in where:
                inputs.append((where[id(example)], -1))
            elif isinstance(example, torch.SymInt) and example.node.expr in sizes:
                inputs.append(sizes[example.node.expr])
            else:
                return
        self.inputs = tuple(inputs)
        self.offsets = tuple((sizes[k], tuple(users)) for k, users in offsets.items())

    def direct(self, result: Any) -> _Direct | None:
        if self.inputs is None or self.compiled is None or self.outputs is None:
            return None
        out = list(self.outputs)
        if result is None:
            form = -1 if not out else None
        elif isinstance(result, Tensor):
            form = 0 if len(out) == 1 and out[0] is result else None
        elif isinstance(result, tuple) and len(result) == len(out) > 0:
            form = len(out) if all(map(operator.is_, result, out)) else None
        else:
            form = None
        if form is None:
            return None
        return _Direct(self.compiled, self.inputs, form, self.offsets)


def compiled(fn: Callable[..., Any], *args: Any) -> _Compiled:
    """``fn`` compiled for arguments like ``args`` (see :class:`_Compiled`)."""
    key = _signature(fn, args)
    out = _COMPILED.get(key)
    if out is None:
        out = _COMPILED[key] = _Compiled(fn)
    return out


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` compiled (see :func:`compiled`). Inside a function that ``torch.compile`` is
    tracing, ``fn`` itself is traced into the caller's graph.

    If compiling fails (no C++ compiler, an unsupported device...), ``fn`` runs eagerly: when
    that succeeds the failure was the compiler's, so this warns once and runs ``fn`` eagerly from
    then on; when eager raises too, the arguments are at fault and that error surfaces, the
    compiled kernel still in use for later calls. An error raised once the compiled code has
    started (which may have written part of its outputs) surfaces as itself: ``fn`` is never
    run a second time on the same arguments."""
    if fn in _FAILED or torch.compiler.is_compiling():
        return fn(*args)
    return _run(fn, args, lambda: compiled(fn, *args), lambda: _FAILED.add(fn))


def compiles_here() -> bool:
    """Whether compiled code runs where the engine is called: not while ``torch.compile`` is
    already tracing, not under a user's ``TorchDispatchMode`` (an op or collective counter:
    there torch.compile runs no compiled code, and with ``fullgraph`` it raises), not inside a
    ``torch.func`` transform (vmap, grad: dynamo cannot trace the update)."""
    return not (
        torch.compiler.is_compiling()
        # (dynamo's own test: modes that declare ignore_compile_internals(), such as the alias
        # check torch.compile runs around the first call of a compiled graph, do not count)
        or _python_dispatch.is_in_any_mode_without_ignore_compile_internals()
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


class Kernel:
    """``fn`` compiled as :func:`call` compiles it, with its compiled signatures held by this
    object instead of the module's cache (a function made for one owner, such as a transform's
    step over one leaf, is compiled and freed with its owner). ``kernel(*args)`` runs it, with
    :func:`call`'s fallback to eager if compiling fails."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: dict[_Key, _Compiled] = {}
        self.failed = False

    def _for(self, args: tuple[Any, ...]) -> _Compiled:
        key = _signature(self.fn, args)
        out = self.compiled.get(key)
        if out is None:
            out = self.compiled[key] = _Compiled(self.fn)
        return out

    def _fail(self) -> None:
        self.failed = True

    def direct(self, *args: Any) -> Callable[..., Any] | None:
        """The compiled kernel for arguments like ``args`` once it is called without dynamo
        (after its first call), else ``None``: a caller that makes many calls of one signature
        (the same tensors each step) may keep it and call it straight, skipping the search by
        signature. It still checks its inputs' sizes and strides (a mismatch goes back through
        dynamo)."""
        if self.failed:
            return None
        kernel = self.compiled.get(_signature(self.fn, args))
        return kernel if kernel is not None and kernel.direct is not None else None

    def __call__(self, *args: Any) -> Any:
        if self.failed or torch.compiler.is_compiling():
            return self.fn(*args)
        return _run(self.fn, args, lambda: self._for(args), self._fail)

    def kept_call(
        self, kept: dict[Any, Callable[..., Any]], key: Any, args: tuple[Any, ...]
    ) -> Any:
        """``self(*args)``, through the compiled kernel kept in ``kept`` under ``key`` once
        there is one (:meth:`direct`: for a caller that makes the same call every step)."""
        found = kept.get(key)
        if found is not None:
            return found(*args)
        out = self(*args)
        direct = self.direct(*args)
        if direct is not None:
            kept[key] = direct
        return out


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kernel_for: Callable[[], _Compiled],
    failed: Callable[[], None],
) -> Any:
    """``kernel_for()(*args)``; if compiling fails, ``fn(*args)`` eagerly, then ``failed()`` and
    a warning (see :func:`call`)."""
    kernel: _Compiled | None = None
    try:
        kernel = kernel_for()
        return kernel(*args)
    except Exception as err:
        if kernel is not None and kernel.started:
            raise
        failure = err
    # Nothing was written (the compiled code never ran): eager decides whose fault it was.
    out = fn(*args)
    failed()
    warnings.warn(
        f"functional_opt: torch.compile of {fn.__name__} failed ({failure!r}); running it eagerly",
        RuntimeWarning,
        stacklevel=4,
    )
    return out
