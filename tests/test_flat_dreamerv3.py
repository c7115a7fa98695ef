"""DreamerV3Optimizer's fast path (flat buffers, compiled kernels) against a float64 oracle of
its documented math and against the generic path.

Comparisons follow the tolerance rule of ``conftest.py``. The oracle tests are teacher-forced:
before each step the oracle takes the optimizer's own params and state, so each step is
compared on its own at one step's count of roundings. Their data make the clip factor's norms
exact in float32 (every element of a gradient is ``+-c`` and of a param ``+-d``, ``c`` and ``d``
powers of two: each partial sum of squares is a multiple of ``c**2`` that float32 holds exactly,
in any order), so the bound does not grow with a tensor's size and stays far below one rounding
to 16 bits (``||g||`` and ``||p||`` then err only by their square roots' rounding).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, assert_close_rounding, dreamerv3_leaf_ops, eps

import functional_opt as fo
from functional_opt import _kernels
from functional_opt.adapters import DreamerV3Optimizer
from functional_opt.adapters.flat_dreamerv3 import DIRECT, MERGE, FlatBucket

# Run again on the CPU's second code path (``make test``): the tests whose results are compared
# within a rounding bound; the routes' bit-for-bit comparisons and the recompile counts are not.
numerics = pytest.mark.numerics

# Roundings in float32 of one step of one element, per implementation (conftest's rule):
# conftest.DREAMERV3_ELEMENTWISE_OPS (23: the clip factor from the norms, both moments, the
# normalized step, bias corrections and learning rate) plus the two norms' square roots (their
# sums are exact here: 2).
STEP_OPS = 23 + 2


def shapes() -> list[tuple[int, ...]]:
    """Every route of the flat path: merged small runs, a 0-d param, a staged run (three equal
    tensors, ``3 * 30000 >= MERGE``), direct params (``>= DIRECT`` elements, contiguous, at
    offset 0)."""
    return [
        (3, 5),
        (5,),
        (3, 5),
        (7,),
        (),
        (1,),
        (MERGE + 3,),
        (2, MERGE // 2),
        (100, 300),
        (20000,),
        (300, 100),
        (200, 200),
        (100, 300),
        (20000,),
    ]


def on_route(opt: DreamerV3Optimizer, route: str) -> DreamerV3Optimizer:
    """``opt`` set to step by ``route``: ``"flat"`` (the hand-fused flat path, the default),
    ``"generic"`` (the per-tensor path) or ``"engine"`` (``TransformOptimizer``'s engine, even for
    a small group: params of at least ``DIRECT`` elements on its direct route, the others
    packed)."""
    opt.flat_step = route == "flat"
    if route == "engine":
        opt.fused_min_numel = 0
        opt.direct_min_numel = DIRECT
        opt.direct_rest_max = 0
    return opt


def engine_of(opt: DreamerV3Optimizer) -> Any:
    """The group's engine (a ``PackedGroup``), which must have stepped."""
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine and engine.steps > 0, "the engine did not step the group"
    return engine


def make_params(
    dtype: torch.dtype = torch.float32, seed: int = 0, contiguous: bool = False
) -> list[torch.nn.Parameter]:
    """Params on every route, plus (unless ``contiguous``) a transposed param and one at a
    storage offset (both staged: the direct route needs a contiguous param at the start of its
    storage; the transposed one makes the staged params' new values be copied back instead of
    their updates added in place)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes()]
    if contiguous:
        return out
    transposed = (torch.randn(300, 120, generator=g) * 0.5).to(dtype).t()
    base = (torch.randn(DIRECT + 10, generator=g) * 0.5).to(dtype)
    out += [torch.nn.Parameter(transposed), torch.nn.Parameter(base[10:])]
    return out


def signs(p: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, p.shape, generator=g).to(torch.float64) * 2 - 1


def exact_data(params: list[torch.nn.Parameter], step: int, skip: set[int]) -> None:
    """Params set to ``+-d`` and gradients to ``+-c`` (powers of two, varying per param so that
    some are clipped and some not; tiny ``d`` on small params makes ``parameter_norm_min``
    act), in place: the params keep their storage."""
    with torch.no_grad():
        for i, p in enumerate(params):
            d = 2.0 ** -(2 + (i + step) % 4) if p.numel() > 8 else 2.0**-14
            c = 2.0 ** -(1 + (3 * i + step) % 6)
            p.copy_(signs(p, 1000 * step + i) * d)
            grad = (signs(p, 5000 + 1000 * step + i) * c).to(p.dtype)
            p.grad = None if i in skip else grad


def random_grads(params: list[torch.nn.Parameter], step: int) -> list[torch.Tensor]:
    """Gradients of step ``step`` for the free-running tests (scales 1e-2 to 10 by param)."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(p.shape, generator=g) * 10.0 ** (i % 4 - 2)).to(p.dtype)
        for i, p in enumerate(params)
    ]


def oracle(
    p: torch.Tensor,
    g: torch.Tensor,
    nu: torch.Tensor,
    mu: torch.Tensor,
    t: int,
    group: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """One documented DreamerV3Optimizer update in float64 (the clipped gradient never rounded:
    16-bit gradients are clipped in float32, which is exact next to 16 bits), with the
    magnitudes of the terms each result is a sum of (the rule's scales)."""
    p, g, nu, mu = (x.detach().to(torch.float64) for x in (p, g, nu, mu))
    b1, b2, agc, pmin = group["beta1"], group["beta2"], group["agc"], group["parameter_norm_min"]
    factor = 1.0
    if agc > 0:
        upper = agc * torch.clamp(torch.linalg.vector_norm(p), min=pmin)
        factor = 1.0 / torch.clamp(torch.linalg.vector_norm(g) / upper, min=1.0)
    gs = g * factor
    nu_new = b2 * nu + (1 - b2) * gs * gs
    r = gs / (torch.sqrt(nu_new / (1 - b2**t)) + group["eps"])
    mu_new = b1 * mu + (1 - b1) * r
    warmup = group["warmup_steps"]
    lr = group["lr"] * (min(1.0, (t - 1) / warmup) if warmup else 1.0)
    step = lr / (1 - b1**t)
    mu_mag = b1 * mu.abs() + (1 - b1) * r.abs()
    return {
        "p": p - step * mu_new,
        "nu": nu_new,
        "mu": mu_new,
        "nu_mag": b2 * nu.abs() + (1 - b2) * gs * gs,
        "mu_mag": mu_mag,
        "p_mag": p.abs() + step * mu_mag,
    }


def snapshot(opt: DreamerV3Optimizer, params: list[torch.nn.Parameter]) -> list[Any]:
    out = []
    for p in params:
        entry = opt.state.get(p, {})
        nu = entry.get("rms", torch.zeros_like(p, dtype=torch.float64))
        mu = entry.get("momentum", torch.zeros_like(p, dtype=torch.float64))
        grad = None if p.grad is None else p.grad.detach().clone()
        out.append((p.detach().clone(), grad, nu.detach().clone(), mu.detach().clone()))
    return out


def check_step(
    opt: DreamerV3Optimizer, params: list[torch.nn.Parameter], before: list[Any]
) -> None:
    """The params and state after ``opt``'s last step against the oracle from ``before``."""
    group = opt.param_groups[0]
    t = group["step"]  # the update just made
    for i, (p, (p0, g0, nu0, mu0)) in enumerate(zip(params, before, strict=True)):
        if g0 is None:  # no gradient: value and state untouched, bit for bit
            assert_bitwise(p.detach(), p0, f"param {i}")
            if p in opt.state:
                assert_bitwise(opt.state[p]["rms"], nu0, f"rms {i}")
                assert_bitwise(opt.state[p]["momentum"], mu0, f"momentum {i}")
            continue
        want = oracle(p0, g0, nu0, mu0, t, group)
        nu, mu = opt.state[p]["rms"], opt.state[p]["momentum"]
        assert (
            nu.dtype == mu.dtype == (torch.float64 if p.dtype == torch.float64 else torch.float32)
        )
        wide = nu.dtype
        where = f"param {i} {tuple(p.shape)} step {t}"
        check = {"check_dtype": False}
        assert_close_rounding(
            nu, want["nu"], dtype=wide, ops=STEP_OPS, scale=want["nu_mag"], msg=where, **check
        )
        assert_close_rounding(
            mu, want["mu"], dtype=wide, ops=STEP_OPS, scale=want["mu_mag"], msg=where, **check
        )
        # The param: the update's roundings (float32 for 16-bit params) and the sum's, plus one
        # rounding to a 16-bit param's dtype (the only one: the update is computed in float32).
        ops = {wide: STEP_OPS + 1} | ({p.dtype: 1} if p.dtype != wide else {})
        assert_close_rounding(
            p.detach(), want["p"], dtype=wide, ops=ops, scale=want["p_mag"], msg=where, **check
        )


OPTIONS = [
    {"lr": 1e-2, "warmup_steps": 0},
    {"lr": 1e-2, "warmup_steps": 2, "agc": 0.05},
    {"lr": 3e-3, "warmup_steps": 0, "agc": 0.0, "beta1": 0.5, "eps": 1e-8},
]


# every options set in float32 and bfloat16; float64 (the same kernels' code in another dtype)
# with the first (suite time: each case compiles its kernels). The second CPU code path runs two
# sets, one per 16-bit and 32-bit kernels (clipping and warm-up in the bfloat16 one).
SECOND_PATH = {"bfloat16-options1", "float32-options2"}
CASES = [
    pytest.param(
        options,
        dtype,
        id=f"{str(dtype)[6:]}-options{k}",
        marks=[numerics] if f"{str(dtype)[6:]}-options{k}" in SECOND_PATH else [],
    )
    for k, options in enumerate(OPTIONS)
    for dtype in (torch.float32, torch.float64, torch.bfloat16)
    if dtype != torch.float64 or k == 0
]


@pytest.mark.parametrize(("options", "dtype"), CASES)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "generic"])
def test_each_step_matches_the_float64_oracle(
    options: dict[str, float], dtype: torch.dtype, flat: bool
) -> None:
    # Both paths, every route, 16-bit gradients clipped in float32 (rounding the clipped
    # gradient to bfloat16, as the flat path once did, errs by up to 2**-8 relative: far
    # outside the float32 bound of the moments). Options change between steps (a stale value
    # baked into a compiled kernel would show), and some params skip steps.
    params = make_params(dtype)
    opt = DreamerV3Optimizer(params, **options)
    opt.flat_step = flat
    for t in range(1, 6):
        if t == 4:
            opt.param_groups[0].update(lr=options["lr"] / 3, beta2=0.99)
            if options.get("agc", 0.3):
                opt.param_groups[0]["agc"] = 0.1
        exact_data(params, t, skip={1, 4, 7} if t == 2 else set())
        before = snapshot(opt, params)
        opt.step()
        check_step(opt, params, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_updates_added_in_place_match_the_oracle_and_the_copy_back(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Contiguous float32/64 params: the staged and merged params get their updates added in
    # their own storage (fused SGD with lr = -1). Each step matches the oracle, and the values
    # are bit for bit those of copying ``p + u`` back, with params skipping steps.
    build = FlatBucket.__init__

    def copy_back(bucket: FlatBucket, *args: Any, **kwargs: Any) -> None:
        build(bucket, *args, **kwargs)
        bucket.add_back = False

    runs = []
    for add_back in (True, False):
        if not add_back:
            monkeypatch.setattr(FlatBucket, "__init__", copy_back)
        params = make_params(dtype, contiguous=True)
        opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0, agc=0.05)
        for t in range(1, 5):
            exact_data(params, t, skip={1, 6, 8} if t == 2 else set())
            before = snapshot(opt, params)
            opt.step()
            check_step(opt, params, before)
        assert [b.add_back for b in opt._buckets[0][1]] == [add_back]
        runs.append([p.detach().clone() for p in params])
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        assert_bitwise(a, b, f"param {i}")


@numerics
def test_16bit_gradients_are_clipped_in_float32() -> None:
    # The rule on its own: one step of clipped bfloat16 params (a direct one and a merged one)
    # whose clipped gradient, 0.3 * 2**-3 = 0.0375, is no bfloat16 number. The flat path's
    # moments equal the generic path's within float32 rounding, and the second moment,
    # (1 - b2) g'^2 on the first step, is that of the float32 clipped gradient, far from that
    # of the clipped gradient rounded to bfloat16. So does the engine's (the direct param's
    # kernel converts the gradient as it reads it, the packed one's buffer is float32).
    results = []
    for route in ("flat", "generic", "engine"):
        p = torch.nn.Parameter(torch.full((DIRECT,), 2.0**-3, dtype=torch.bfloat16))
        q = torch.nn.Parameter(torch.full((300,), 2.0**-3, dtype=torch.bfloat16))
        opt = on_route(DreamerV3Optimizer([p, q], lr=1e-2, warmup_steps=0, agc=0.3), route)
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
        opt.step()
        results.append([opt.state[x][k].clone() for x in (p, q) for k in ("rms", "momentum")])
        if route == "engine":
            engine = engine_of(opt)
            assert engine.direct == [0] and engine.rest == [1]
            assert [b.dtype for b in engine.grads] == [torch.float32]
            assert p.grad.dtype == q.grad.dtype == torch.bfloat16  # never rebound to a view
    for other in results[1:]:
        assert_close_rounding(results[0], other, dtype=torch.float32, ops=STEP_OPS)
    exact = (1 - 0.999) * (0.3 * 2.0**-3) ** 2
    rounded = (1 - 0.999) * float(torch.tensor(0.3 * 2.0**-3).to(torch.bfloat16)) ** 2
    bound = STEP_OPS * eps(torch.float32) * exact
    assert abs(rounded - exact) > 100 * bound  # the test can tell the two apart
    for run in (results[0], results[2]):
        for nu in (run[0], run[2]):
            assert (nu - exact).abs().max().item() <= bound


@pytest.mark.parametrize(
    ("dtype", "route"),
    # (the second CPU code path runs the 16-bit case; the engine's route, which compiled for
    # 37 s with a cold cache here, has its own cross-path tests of dreamerv3 in test_engine and
    # test_engine_direct, and its 16-bit clipping in test_16bit_gradients_are_clipped_in_float32)
    [(torch.float32, "flat"), pytest.param(torch.bfloat16, "flat", marks=numerics)],
)
def test_flat_path_matches_generic_path_over_steps(dtype: torch.dtype, route: str) -> None:
    # Free-running (no teacher forcing), random data: after 6 steps the two paths agree within
    # the rule's count for 6 updates of each leaf (its norms' sums included), relative to the
    # magnitudes of the terms (the start plus every update's magnitude, from a float64 run of
    # the transform on absolute values).
    options = {"lr": 1e-2, "warmup_steps": 2, "agc": 0.3}
    runs = []
    for name in (route, "generic"):
        params = make_params(dtype, seed=3)
        opt = on_route(DreamerV3Optimizer(params, **options), name)
        for t in range(6):
            for p, grad in zip(params, random_grads(params, t), strict=True):
                p.grad = grad
            opt.step()
        runs.append([p.detach().clone() for p in params])
    scale = magnitudes(make_params(dtype, seed=3), dtype, options, steps=6)
    assert_close_rounding(
        runs[0],
        runs[1],
        dtype=torch.float32,
        ops=dreamerv3_leaf_ops(dtype, steps=6, apply=True),
        scale=scale,
    )


def magnitudes(
    params: list[torch.nn.Parameter], dtype: torch.dtype, options: dict[str, float], steps: int
) -> list[torch.Tensor]:
    """``|p0| + sum_t |u_t|`` with ``|u_t|`` the update of ``dreamerv3`` run in float64 on the
    absolute values of the same gradients and params (conftest's magnitude run)."""
    from conftest import MagnitudeRun

    tx = fo.dreamerv3(
        lr=options["lr"], agc=options["agc"], pmin=1e-3, warmup=int(options["warmup_steps"])
    )
    values = [p.detach().to(torch.float64) for p in params]
    run = MagnitudeRun(tx, values)
    total = [v.abs() for v in values]
    for t in range(steps):
        grads = [x.to(torch.float64) for x in random_grads(params, t)]
        u, _ = run.update(grads, values)
        total = [a + b for a, b in zip(total, u, strict=True)]
    return total


def test_params_without_gradient_are_untouched() -> None:
    params = make_params()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    exact_data(params, 0, skip=set())
    opt.step()
    # A merged, a staged, a direct, the transposed and the offset param skip three steps.
    skipped = {1, 8, 6, len(params) - 2, len(params) - 1}
    frozen = {i: params[i].detach().clone() for i in skipped}
    state = {i: {k: v.clone() for k, v in opt.state[params[i]].items()} for i in skipped}
    for t in range(1, 4):
        exact_data(params, t, skip=skipped)
        with torch.no_grad():
            for i in skipped:
                params[i].copy_(frozen[i])
        opt.step()
    for i in skipped:
        assert_bitwise(params[i].detach(), frozen[i], f"param {i}")
        for k, v in state[i].items():
            assert_bitwise(opt.state[params[i]][k], v, f"{k} of param {i}")
    never = make_params()
    opt = DreamerV3Optimizer(never, lr=1e-2, warmup_steps=0)
    exact_data(never, 0, skip={2, 6})
    before = [never[i].detach().clone() for i in (2, 6)]
    opt.step()
    for i, b in zip((2, 6), before, strict=True):
        assert_bitwise(never[i].detach(), b)
        assert never[i] not in opt.state


def test_checkpoint_round_trip_and_repointed_params_stay_exact() -> None:
    def run(save_at: int | None) -> list[torch.Tensor]:
        params = make_params()
        opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=2)
        for t in range(6):
            if t == save_at:
                buffer = io.BytesIO()
                torch.save(
                    {"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer
                )
                buffer.seek(0)
                ckpt = torch.load(buffer, weights_only=True)
                params = make_params(seed=1)
                with torch.no_grad():
                    for p, v in zip(params, ckpt["params"], strict=True):
                        p.copy_(v)
                opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=2)
                opt.load_state_dict(ckpt["opt"])
            if t == 4:  # someone replaces the storage of a merged and a direct param
                params[0].data = params[0].data.clone()
                params[6].data = params[6].data.clone()
            for p, grad in zip(params, random_grads(params, t), strict=True):
                p.grad = grad
            opt.step()
        return [p.detach().clone() for p in params]

    assert_bitwise(run(None), run(3))


def test_state_entries_are_views_of_the_buckets() -> None:
    params = make_params()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    exact_data(params, 0, skip=set())
    opt.step()
    rms = [opt.state[p]["rms"] for p in params]
    assert len({t.untyped_storage().data_ptr() for t in rms}) == 1
    assert all(
        t.dtype == torch.float32 and t.shape == p.shape for t, p in zip(rms, params, strict=True)
    )


def compilations() -> tuple[int, int]:
    """(graphs compiled by ``functional_opt._kernels``, graphs compiled by dynamo)."""
    ours = sum(k._graphs for k in _kernels._COMPILED.values()) + len(_kernels._COMPILED)
    return ours, int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_changing_hyperparameters_does_not_recompile(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counted directly: the graphs functional_opt._kernels compiles (kernels of its own, so
    # that other tests' kernels do not hide a compilation) and dynamo's count of graphs.
    monkeypatch.setattr(_kernels, "_COMPILED", {})
    params = make_params(dtype)
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=3)
    for t in range(2):  # every route's kernels compiled (agc > 0 and, on step 1, warm-up 0)
        exact_data(params, t, skip=set())
        opt.step()
    opt.param_groups[0]["agc"] = 0.0
    exact_data(params, 2, skip=set())
    opt.step()  # the kernels of agc == 0 too
    start = compilations()
    changes = [(3e-3, 0.3, 0.999, 0.5), (1e-4, 0.1, 0.99, 0.8), (2e-2, 0.0, 0.9, 0.9)]
    for t, (lr, agc, beta2, beta1) in enumerate(changes, start=3):
        opt.param_groups[0].update(lr=lr, agc=agc, beta2=beta2, beta1=beta1, eps=1e-8 * t)
        exact_data(params, t, skip={0, 6} if t == 4 else set())
        before = snapshot(opt, params)
        opt.step()
        check_step(opt, params, before)  # the new values are used, not stale ones
    assert compilations() == start
    # The counts do see a compilation: a group of another dtype needs kernels of its own.
    extra = [torch.nn.Parameter(torch.randn(MERGE + 1, dtype=torch.float64))]
    opt.add_param_group({"params": extra})
    extra[0].grad = torch.randn_like(extra[0])
    opt.step()
    after = compilations()
    assert after[0] > start[0] and after[1] > start[1]


def test_each_kernel_is_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels take their float64 scalars (``1/bc2``, the betas, ``eps``) as one vector on
    the CPU: dynamo traces a 0-d float64 CPU tensor argument as a symbolic float that the
    compile cannot keep, and then traces and compiles the kernel a second time. With the
    compiler's caches off (as in a first run), every graph goes through AOT autograd once."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(_kernels, "_COMPILED", {})
    params = make_params(torch.float32)
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=3)
    counters.clear()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        for t in range(2):
            exact_data(params, t, skip=set())
            opt.step()
    compiles = dict(counters["aot_autograd"])
    assert compiles.get("ok", 0) >= 2 and compiles.get("total") == compiles.get("ok"), compiles


def test_step_under_torch_compile_matches_eager() -> None:
    # Compiling optimizer.step traces the kernels into the step's own graphs: the same math as
    # eager, other kernels (3 steps, random data: the rule's count per leaf). (Not on the second
    # CPU code path: compiling the step again there took 35 s; compiled against eager DreamerV3
    # runs there in test_oracle_dreamerv3's compiled routes.)
    options = {"lr": 1e-2, "warmup_steps": 0, "agc": 0.3}
    eager, compiled = make_params(), make_params()
    opt_eager = DreamerV3Optimizer(eager, **options)
    opt_compiled = DreamerV3Optimizer(compiled, **options)
    step = torch.compile(opt_compiled.step)
    for t in range(3):
        for params in (eager, compiled):
            for p, grad in zip(params, random_grads(params, t), strict=True):
                p.grad = grad
        opt_eager.step()
        step()
    assert_close_rounding(
        [p.detach() for p in compiled],
        [p.detach() for p in eager],
        dtype=torch.float32,
        ops=dreamerv3_leaf_ops(torch.float32, steps=3, apply=True),
        scale=magnitudes(make_params(), torch.float32, options, steps=3),
    )


def test_a_refused_step_leaves_gradients_and_params_alone() -> None:
    # One group, two buckets: the float64 one has a sparse gradient (the flat path cannot take
    # it; the generic path refuses it). Nothing changes, not even which tensor the float32
    # param's fresh gradient is (copying it into its bucket used to come first). Also a bad
    # option is refused before any bucket is touched.
    a = torch.nn.Parameter(torch.randn(MERGE + 5))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = DreamerV3Optimizer([a, b], lr=1e-2, warmup_steps=0)
    grad = torch.randn_like(a)
    a.grad = grad
    b.grad = torch.sparse_coo_tensor([[1]], [1.0], (4,), dtype=torch.float64, check_invariants=True)
    values = [a.detach().clone(), b.detach().clone()]
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert a.grad is grad
    assert_bitwise([a.detach(), b.detach()], values)
    assert not opt.state
    b.grad = torch.randn_like(b)
    opt.step()  # builds the buckets; a.grad is now a view of its bucket
    view = a.grad
    a.grad = torch.randn_like(a)
    fresh = a.grad
    opt.param_groups[0]["beta1"] = 1.5
    with pytest.raises(ValueError, match="beta1"):
        opt.step()
    assert a.grad is fresh and a.grad is not view
