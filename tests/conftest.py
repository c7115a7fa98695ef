"""The test suite's one rule for comparing floating-point results, and its shared pytest setup.

Tolerance rule
--------------
Every numerical comparison in ``tests/`` is one of two kinds (see also ``tests/README.md``):

1. **The same kernel on the same inputs: bit for bit** (:func:`assert_bitwise`). Pure vs donated
   updates, a direct call of a compiled graph vs the dynamo-called one, a packed tree vs the
   loose tree when both run one kernel: any difference is a bug, so no tolerance is allowed.
   (NaNs must sit in the same places; their payloads are not compared.)

2. **Two implementations of the same math: a bound derived from rounding**
   (:func:`assert_close_rounding`). Compiled vs eager, fused vs chain, flat vs generic, ours vs
   the float64 oracle. The bound is::

       |actual - expected| <= ops * eps(dtype) * scale  (+ ops * eps(dtype) * tiny(dtype))

   * ``eps(dtype)`` is ``torch.finfo(dtype).eps``, twice the unit roundoff ``u``: one correctly
     rounded operation (``+ - * / sqrt``, a cast to ``dtype``) has relative error at most ``u``.
   * ``ops`` counts the roundings to ``dtype`` on the way from the inputs to the compared value
     (casts of a hyperparameter to ``dtype`` included), written at the call site with how it was
     counted. If ``k`` roundings each err by at most ``u``, each implementation is within
     ``k u`` (first order) of the exact value, so two of them are within ``2 k u = k eps``; one
     compared with a float64 oracle is within ``k u`` plus the oracle's own (far smaller)
     error, so the same ``k eps`` bound holds with room to spare. A sum of ``n`` terms counts
     ``n`` roundings whatever its order (Higham, *Accuracy and Stability of Numerical
     Algorithms*, 4.2), relative to the sum of the terms' magnitudes; a sequence of steps adds
     the steps' counts (errors carried in state add up, decays only shrink them). Roundings in
     a wider dtype inside a narrow computation (float32 moments of bfloat16 params) are counted
     separately: ``ops={torch.bfloat16: 3, torch.float32: 20}``.
   * ``scale`` is the magnitude of the terms the value is computed from: rounding errors are
     relative to the terms, not to the result, which cancellation can make far smaller. By
     default it is the largest magnitude in the expected tensor (a norm-wise bound per tensor,
     the usual measure for a vector of parameters); a test whose values come from cancelling
     terms passes the terms' magnitudes as a tensor (:func:`abs_run` computes them by running
     the same math on absolute values, Higham's bound for sums and products).
   * ``tiny(dtype)`` is the smallest normal number: below it the relative bound no longer holds
     (gradual underflow), and each rounding may add an absolute ``eps * tiny``.

   A count is never raised to make a test pass on one machine: if a bound derived this way
   fails, either the count missed an operation (then the comment says which) or the code has
   a bug.

Second CPU code path
--------------------
``make test`` runs the tests marked ``numerics`` a second time with ``ATEN_CPU_CAPABILITY`` set
(``Makefile``): ATen's eager kernels and inductor's generated C++ then use another vector ISA,
so a tolerance tuned to one machine's rounding fails on the developer's machine too. Inductor's
on-disk cache does not key its compiled graphs by that ISA (a graph compiled for AVX-512 and
loaded under ``ATEN_CPU_CAPABILITY=avx2`` computes garbage, and its precompiled header for one
ISA fails to compile kernels for another), so this file gives each capability a cache
directory of its own: a subdirectory of ``TORCHINDUCTOR_CACHE_DIR`` where that is set (a CI
that keeps inductor's cache between runs), else one beside inductor's default.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence

import pytest

_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
if _CAPABILITY:
    # (before anything compiles: inductor reads the variable whenever it looks for its cache)
    _given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    _user = os.environ.get("USER") or str(os.getuid())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
        os.path.join(_given, f"capability_{_CAPABILITY}")
        if _given
        else os.path.join(tempfile.gettempdir(), f"torchinductor_{_user}_{_CAPABILITY}")
    )

import torch  # noqa: E402  (after the cache directory is chosen)

NUMERICS = "numerics"
"""The marker of tests whose results depend on the CPU's code path (kernels, fused, packed and
flat DreamerV3 paths, compiled updates, oracle comparisons): ``make test`` runs them twice."""


def second_path(values: Sequence[str], *, on: Sequence[str]) -> list[object]:
    """``values`` for ``pytest.mark.parametrize`` (each its own id), the :data:`NUMERICS` mark on
    those in ``on`` only: the second CPU code path reruns the cases that cover its code (each
    case compiles its transform again there, for another vector ISA, with a cold cache)."""
    missing = set(on) - set(values)
    if missing:
        raise ValueError(f"second_path: {sorted(missing)} are not among the values")
    return [
        pytest.param(v, id=v, marks=[getattr(pytest.mark, NUMERICS)] if v in on else [])
        for v in values
    ]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{NUMERICS}: results depend on the CPU code path (ATen/inductor vector ISA); "
        "`make test` runs these again under ATEN_CPU_CAPABILITY (see tests/README.md)",
    )
    if _CAPABILITY:  # torch ignores a value it cannot honour: then this pass would repeat the first
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        aten = torch.backends.cpu.get_cpu_capability().lower()
        inductor = str(pick_vec_isa()).split()[0].lower() if pick_vec_isa() else "default"
        if aten != _CAPABILITY or inductor != _CAPABILITY:
            raise pytest.UsageError(
                f"ATEN_CPU_CAPABILITY={_CAPABILITY!r} is not in effect (ATen runs {aten!r}, "
                f"inductor generates {inductor!r}): this CPU or torch build cannot run that path"
            )


# --- the tolerance rule -------------------------------------------------------------------
# (the helpers are functional_opt.testing's, public for users: one copy)
from functional_opt.testing.tolerance import (  # noqa: E402, F401
    MagnitudeRun,
    Ops,
    abs_run,
    assert_bitwise,
    assert_close_rounding,
    eps,
    rounding_bound,
)

DREAMERV3_ELEMENTWISE_OPS = 23
"""Roundings in the moments' dtype of one ``dreamerv3`` update of one element, per
implementation: the kernels' math (14, counted in ``test_kernels_direct.py``: clip factor
times g, both moments, the normalized step, the update with weight decay), Nesterov's second
mix (cast, product, sum: 17), the clip factor from the two norms (``clip * max(pmin, ||p||)``:
cast and product, then the quotient: 20; the norms' sums are counted by :func:`dreamerv3_ops`),
the bias corrections and learning rate computed in float64 and cast (2: 22), and the float64
roundings of the schedule and the powers (far below one rounding of the moments: 1)."""

DREAMERV3_16BIT_OPS = 7
"""Roundings to a 16-bit param's dtype in one ``dreamerv3`` update (the chain's route; the
kernels round less): the clipped gradient (1); the normalized step ``g' / sqrt(nu')`` rounded to
the param's dtype (1, plus g''s 1 and half of nu''s 2: 3); the float32 momentum, an average of
such steps (averaging adds no relative error of its terms up: 3); its bias-corrected value
rounded (4); weight decay's product and sum (6); the learning rate's product (7). Not
multiplied by the steps: state keeps these errors averaged, not summed (the moments' own
roundings, in float32, are)."""


def dreamerv3_ops(
    dtype: torch.dtype, *, numel: int, steps: int = 1, apply: bool = False
) -> dict[torch.dtype, float]:
    """The rule's ``ops`` for two implementations of ``dreamerv3`` on params of ``dtype`` after
    ``steps`` updates from one start, each carrying its own state (errors in state add up):
    :data:`DREAMERV3_ELEMENTWISE_OPS` plus the clip factor's norms over the leaf (``numel``
    squares summed, halved by the square root, two norms: ``numel + 2``; pass 0 where the clip
    never acts) per step, in the moments' dtype (float32 for 16-bit params), plus
    :data:`DREAMERV3_16BIT_OPS` for 16-bit params; ``apply``: compared after the update is
    added to the param (one more rounding, in the param's dtype)."""
    narrow = dtype in (torch.bfloat16, torch.float16)
    wide = torch.float32 if narrow else dtype
    per_step = DREAMERV3_ELEMENTWISE_OPS + (numel + 2 if numel else 0)
    ops: dict[torch.dtype, float] = {wide: steps * per_step}
    if narrow:
        ops[dtype] = DREAMERV3_16BIT_OPS
    ops[dtype] = ops[dtype] + (1 if apply else 0)
    return ops


def dreamerv3_leaf_ops(
    dtype: torch.dtype, *, steps: int = 1, apply: bool = False
) -> Callable[[torch.Tensor], Ops]:
    """:func:`dreamerv3_ops` for each compared leaf, its clip factor's norms over that leaf's
    own elements (``clip_by_agc`` clips each tensor by its own norms)."""
    return lambda leaf: dreamerv3_ops(dtype, numel=leaf.numel(), steps=steps, apply=apply)


SCHEDULE_OPS = 32
"""Roundings of one schedule value in float64, per implementation: a cosine decay's fraction
(1), its angle (1), the cosine (correctly rounded to about an ulp, plus the angle's error times
``|sin| <= pi``: 5), ``1 + cos`` and the half (1), the power (1, plus the exponent <= 3 times
the base's error: 25 so far), the ``(1 - alpha)`` mix (3) and the scale (1): 29; a linear ramp's
quotient, difference, product and sum (4, times 4: its terms ``|init - end| + |end|`` are up to 4
times the largest value it shows once it is well past its start, as the tests' counts take
it). Compared over the counts of one schedule, relative to its largest value (near the end of
a decay the value is a small difference of terms of that size); a schedule cut short before
it shows its range (a part of a join) passes its terms' magnitude instead."""

ELEMENTWISE_OPS = 32
"""Roundings per element in one update of the longest elementwise chain of the optax
namesakes (adamw with Nesterov, ``eps_root``, weight decay and a cosine schedule: first moment
3, second 4, both bias corrections (power, difference, quotient: 3 each), the Nesterov mix 4,
``sqrt(v + eps_root) + eps`` 3, the quotient 1, weight decay 2, the schedule's cosine and
arithmetic 5, the learning rate 1: 31, rounded up). Norms add their sums."""


def step_with_grads(
    runs: Sequence[tuple[Sequence[torch.Tensor], torch.optim.Optimizer]],
    grads: Sequence[torch.Tensor],
) -> None:
    """Each ``(params, optimizer)`` of ``runs``: its params given copies of ``grads``, then a
    step (two optimizers in lockstep on the same gradients)."""
    for params, optimizer in runs:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


def assert_same_steps_then_sync(
    params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
    before: list[torch.Tensor],
    ops: int,
) -> None:
    """Lockstep of two optimizers that stepped from ``before``: the steps they made (``p -
    before``) agree within ``ops`` float32 roundings per element (scaled by ``|before| +
    1e-2``), then ``params`` are set to ``ref_params``, so that each next update is compared
    alone."""
    got = [p.detach() - b for p, b in zip(params, before, strict=True)]
    want = [p.detach() - b for p, b in zip(ref_params, before, strict=True)]
    scale = [b.abs() + 1e-2 for b in before]
    assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
    with torch.no_grad():
        for p, q in zip(params, ref_params, strict=True):
            p.copy_(q)
