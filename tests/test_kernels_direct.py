"""The compiled kernels' direct calls (inductor's graph called without torch._dynamo) give the
results the dynamo-called graph gives (bit for bit: one compiled graph), and fall back to dynamo
whenever the graph might not fit the call (then compared with the eager kernel, other code, at
the tolerance rule's float32 rounding bound: ``tests/conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import abs_run, assert_bitwise, assert_close_rounding

from functional_opt import _kernels

pytestmark = pytest.mark.numerics

# Roundings to float32 on the longest path of the kernels' math (``_kernels.moments_math`` and
# the update), per implementation: g' = g factor (1); g'^2 (2 from g', 1); (1 - b2) and b2 cast
# to float32 (1 each), their products (1 each) and the sum: nu' (6); nu' inv_bc2 (cast 1,
# product 1: 8), sqrt (halves it: 4, +1), + eps (cast and sum: 6), g' / that (1 + 6 + 1 = 8):
# r; b1 mu and (1 - b1) r (cast 1, product 1 each: r's term 10), their sum: mu' (11); step
# cast and product: u (13); + p, or + decay p (cast, product, sum): p' and u (14). Relative to
# the magnitude of the terms (``abs_run``: the same math on absolute values), since b1 mu and
# (1 - b1) r may cancel.
KERNEL_OPS = 14


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "_COMPILED", {})
    monkeypatch.setattr(_kernels, "_FAILED", set())


def _hyper(rows: int | None = None) -> tuple[torch.Tensor, ...]:
    shape = () if rows is None else (rows, 1)
    factor = torch.full(shape, 0.75)
    step = torch.full(shape, -1e-3, dtype=torch.float64 if rows is None else torch.float32)
    scalars = [torch.tensor(x, dtype=torch.float64) for x in (1.25, 0.9, 0.999, 1e-8)]
    return (factor, step, *scalars)


def _moments(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.randn(shape, generator=gen)
    nu = torch.rand(shape, generator=gen)
    mu = torch.randn(shape, generator=gen) * 0.1
    return g, nu, mu


class _CountingDynamo:
    """Counts the calls that go through torch._dynamo."""

    def __init__(self, kernel: _kernels._Compiled) -> None:
        self.inner = kernel._dynamo
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.inner(*args)


def _clone(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _kernel_args(g: torch.Tensor, nu: torch.Tensor, mu: torch.Tensor) -> tuple[Any, ...]:
    factor, step, *scalars = _hyper()
    return (g, nu, mu, factor, step, *scalars)


def _magnitudes(fn: Any, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """The terms' magnitudes of what ``fn`` writes into ``args`` and of what it returns."""
    return abs_run(lambda *xs: (xs, fn(*xs)), *args)  # type: ignore[no-any-return]


def _assert_kernels_agree(got: Any, want: Any, magnitudes: Any) -> None:
    """The compiled and the eager kernel (two codes for one math) agree to float32 rounding."""
    assert_close_rounding(got, want, dtype=torch.float32, ops=KERNEL_OPS, scale=magnitudes)


def _beside_eager(fn: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """``fn`` through the kernels and eagerly on copies of ``args``: both results, after checking
    that both wrote the same (to float32 rounding) into their arguments."""
    eager = _clone(args)
    scales, out_scale = _magnitudes(fn, args)
    got = _kernels.call(fn, *args)
    want = fn(*eager)
    _assert_kernels_agree(args, eager, scales)
    if want is not None:
        _assert_kernels_agree(got, want, out_scale)
    return got, want


def _compiled_and_counted(
    fn: Any, gen: torch.Generator, size: int
) -> tuple[_kernels._Compiled, _CountingDynamo]:
    """``fn``'s compiled kernel after one (compiling) call, its dynamo calls counted from now."""
    first = _kernel_args(*_moments(gen, (size,)))
    _kernels.call(fn, *first)
    kernel = _kernels.compiled(fn, *first)
    assert kernel.direct is not None  # the compiling call set up direct calls
    counter = _CountingDynamo(kernel)
    kernel._dynamo = counter  # type: ignore[method-assign]
    return kernel, counter


@pytest.mark.parametrize(
    "fn",
    [_kernels.update_kernel, _kernels.update_kernel_donated],
    ids=["tuple-result", "tensor-result"],
)
def test_direct_calls_equal_dynamo_calls(fresh: None, fn: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    _, counter = _compiled_and_counted(fn, gen, 300)
    for size in (300, 1000, 37):  # one compiled graph serves every size
        args = _kernel_args(*_moments(gen, (size,)))
        via_dynamo = _clone(args)
        got = _kernels.call(fn, *args)
        want = counter.inner(*via_dynamo)
        assert counter.calls == 0
        if want is None:
            assert got is None
        else:
            want_list = [want] if isinstance(want, torch.Tensor) else list(want)
            got_list = [got] if isinstance(got, torch.Tensor) else list(got)
            assert_bitwise(got_list, want_list)
        assert_bitwise(args, via_dynamo)  # the same in-place writes


def test_sizes_equal_when_compiled_but_not_later_go_back_through_dynamo(fresh: None) -> None:
    # Compiled with rows == columns, dynamo may give both one size symbol; the graph then checks
    # the inputs' sizes itself and a call with other sizes goes back through dynamo.
    gen = torch.Generator().manual_seed(1)
    fn = _kernels.apply_kernel

    def args(rows: int, cols: int) -> tuple[Any, ...]:
        g, nu, mu = _moments(gen, (rows, cols))
        p = torch.randn(rows, cols, generator=gen)
        return (g, p, nu, mu, *_hyper(rows))

    _kernels.call(fn, *args(6, 6))
    kernel = _kernels.compiled(fn, *args(6, 6))
    assert kernel.direct is not None
    for shape in ((6, 9), (4, 6), (6, 6)):
        _beside_eager(fn, args(*shape))


def test_a_failed_size_check_goes_back_through_dynamo(fresh: None) -> None:
    # Whether dynamo gave two equal sizes one symbol depends on what it compiled before, so
    # the check failing is simulated here: the call must then run once, through dynamo.
    gen = torch.Generator().manual_seed(4)
    fn = _kernels.update_kernel_donated
    kernel, counter = _compiled_and_counted(fn, gen, 40)

    def failing_check(*inputs: Any) -> Any:
        raise AssertionError("expected size 40 == 41")

    assert kernel.direct is not None
    kernel.direct = kernel.direct._replace(compiled=failing_check)
    _beside_eager(fn, _kernel_args(*_moments(gen, (41,))))  # (compares the returned updates)
    assert counter.calls == 1 and kernel.direct is None


def test_calls_autograd_records_go_through_dynamo(fresh: None) -> None:
    gen = torch.Generator().manual_seed(2)
    fn = _kernels.update_kernel
    _, counter = _compiled_and_counted(fn, gen, 64)
    g, nu, mu = _moments(gen, (64,))
    g.requires_grad_(True)
    _, _, u = _kernels.call(fn, *_kernel_args(g, nu, mu))
    assert counter.calls == 1 and u.requires_grad
    u.sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all()


def test_an_argument_passed_twice_never_gets_direct_calls(fresh: None) -> None:
    gen = torch.Generator().manual_seed(3)
    g, nu, mu = _moments(gen, (50,))
    factor, _, *scalars = _hyper()
    # the clip factor and the step size are one tensor here: one graph input for two arguments
    args = (g, nu, mu, factor, factor, *scalars)
    _kernels.call(_kernels.update_kernel_donated, *args)
    assert _kernels.compiled(_kernels.update_kernel_donated, *args).direct is None


def test_compiling_keeps_no_reference_to_the_first_call_tensors(fresh: None) -> None:
    import gc
    import weakref

    gen = torch.Generator().manual_seed(5)
    args = _kernel_args(*_moments(gen, (30,)))
    out = _kernels.call(_kernels.update_kernel, *args)
    assert _kernels.compiled(_kernels.update_kernel, *args).direct is not None
    refs = [weakref.ref(t) for t in (*args[:3], *out)]
    del args, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_row_views_at_storage_offsets_get_direct_calls(fresh: None) -> None:
    # The adapter's runs are [rows, n] views at an offset into flat buffers: dynamo makes the
    # offsets graph inputs, which direct calls read from the arguments (the graph does not check
    # offsets, so arguments that shared one offset when compiled must share it later, or the
    # call goes back through dynamo).
    gen = torch.Generator().manual_seed(7)
    fn = _kernels.apply_kernel

    def views(first: int, rows: int, cols: int, shift: int = 0) -> tuple[Any, ...]:
        flats = [torch.randn(64 * cols + shift, generator=gen) for _ in range(4)]
        flats[2] = flats[2].abs()  # nu >= 0
        out = []
        for k, flat in enumerate(flats):
            start = first * cols + (shift if k == 3 else 0)
            out.append(flat[start : start + rows * cols].view(rows, cols))
        factor, step, *scalars = _hyper(64)
        return (*out, factor[first : first + rows], step[first : first + rows], *scalars)

    _kernels.call(fn, *views(3, 5, 40))
    kernel = _kernels.compiled(fn, *views(3, 5, 40))
    assert kernel.direct is not None and kernel.direct.offsets
    counter = _CountingDynamo(kernel)
    kernel._dynamo = counter  # type: ignore[method-assign]
    for first, rows, cols in ((7, 2, 40), (11, 9, 24), (2, 3, 17)):
        args = views(first, rows, cols)
        via_dynamo = views_like(_clone(args), args)
        _kernels.call(fn, *args)
        counter.inner(*via_dynamo)
        assert counter.calls == 0
        assert_bitwise(args, via_dynamo)
    # mu at another offset than g, p and nu: back through dynamo, still right
    _beside_eager(fn, views(5, 4, 40, shift=3))
    assert counter.calls == 1


def views_like(copies: tuple[Any, ...], like: tuple[Any, ...]) -> tuple[Any, ...]:
    """``copies`` placed at the storage offsets of ``like`` (fresh buffers, same values), so that
    the dynamo-called graph sees the layout the direct call saw."""
    out = []
    for c, a in zip(copies, like, strict=True):
        if not isinstance(c, torch.Tensor) or a.storage_offset() == 0:
            out.append(c)
            continue
        base = torch.empty(a.storage_offset() + c.numel(), dtype=c.dtype)
        view = base[a.storage_offset() :].view(c.shape)
        view.copy_(c)
        out.append(view)
    return tuple(out)
