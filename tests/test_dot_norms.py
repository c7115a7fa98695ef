"""Norms of long contiguous float32/float64 tensors as BLAS dot products (``_lists.norms``),
eagerly and inside compiled graphs (the opaque op ``functional_opt::dot_norms``).

The dot product's summation order is the BLAS library's (it differs between CPUs), so the norms
are compared with the float64 norm by rule 2 of tests/README.md: a sum of ``n`` squares takes at
most ``n`` roundings of the sum's magnitude, the square root one more."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_rounding

from functional_opt import _lists


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    long = _lists.DOT_MIN
    return [
        torch.randn(long + 5, generator=gen),  # dot
        torch.randn(7, generator=gen),  # short: _foreach_norm
        torch.randn(64, long // 32, generator=gen).t(),  # not contiguous: _foreach_norm
        torch.randn(3, long, generator=gen).double(),  # dot, float64
        torch.zeros(long),  # dot of zeros
    ]


def _reference(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(x.double()) for x in xs]


def _check(got: list[torch.Tensor], xs: list[torch.Tensor]) -> None:
    assert [n.dtype for n in got] == [x.dtype for x in xs]
    assert all(n.shape == () for n in got)
    for n, want, x in zip(got, _reference(xs), xs, strict=True):
        assert_close_rounding(n, want.to(n.dtype), dtype=x.dtype, ops=x.numel() + 2)


@pytest.mark.numerics
def test_norms_of_long_tensors_are_dot_products_in_order() -> None:
    xs = _tensors()
    got = _lists.norms(xs)
    _check(got, xs)
    assert torch.equal(got[0], torch.dot(xs[0], xs[0]).sqrt())  # the dot route, in place 0
    assert torch.equal(got[1], torch._foreach_norm([xs[1]])[0])


@pytest.mark.numerics
def test_a_compiled_graph_calls_the_dot_op_and_gives_the_eager_norms() -> None:
    xs = _tensors()
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    compiled = torch.compile(lambda *a: _lists.norms(list(a)), backend=backend, fullgraph=True)
    got = compiled(*xs)
    assert "functional_opt.dot_norms" in seen
    _check(list(got), xs)
    for a, b in zip(got, _lists.norms(xs), strict=True):  # the same BLAS calls
        assert torch.equal(a, b)


def test_autograd_through_a_norm_takes_the_differentiable_route() -> None:
    """A tensor autograd records (grad mode, requires_grad) is not given to the dot op, which
    has no derivative: the gradient of ``||x||`` is ``x / ||x||``."""
    x = torch.randn(_lists.DOT_MIN + 1, dtype=torch.float64, requires_grad=True)
    (norm,) = _lists.norms([x])
    norm.backward()
    assert x.grad is not None
    assert torch.allclose(x.grad, x.detach() / x.detach().norm(), rtol=1e-12, atol=0)
    with torch.no_grad():  # no grad mode: the dot route, for a param too
        (again,) = _lists.norms([x])
    assert torch.equal(again, torch.dot(x.detach(), x.detach()).sqrt())


def test_16bit_norms_read_the_16bit_values_also_of_params_and_widened_copies() -> None:
    """A bfloat16 tensor's norm (a ``torch.nn.Parameter``'s too) is accumulated in float32 from
    its 16-bit values, without a float32 copy for the dot op; so is the norm of a float32
    conversion of one that :func:`_lists.widened` declares (the engine's upcast gradients):
    eagerly the same bits as torch's multi-tensor norm of the 16-bit tensor, and inside a
    compiled graph no dot op."""
    gen = torch.Generator().manual_seed(1)
    narrow = (torch.randn(_lists.DOT_MIN + 3, generator=gen)).to(torch.bfloat16)
    param = torch.nn.Parameter(torch.randn(_lists.DOT_MIN, generator=gen).to(torch.bfloat16))
    want = list(torch._foreach_norm([narrow, param.detach()], 2, dtype=torch.float32))

    def norms(x: torch.Tensor, p: torch.Tensor) -> list[torch.Tensor]:
        wide = x.float()
        old = _lists.widened(((wide, x),))
        try:
            return _lists.norms([wide, p])
        finally:
            _lists.widened(old)

    with torch.no_grad():
        got = norms(narrow, param)
    assert _lists._WIDENED == ()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    with torch.no_grad():
        compiled = torch.compile(norms, backend=backend, fullgraph=True)(narrow, param)
    assert seen and "functional_opt.dot_norms" not in seen
    for a, b in zip(compiled, want, strict=True):
        assert_close_rounding(a, b, dtype=torch.float32, ops=narrow.numel() + 2)
