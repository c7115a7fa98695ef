"""TensorDict params: a TensorDict is a node of the library's trees (functional_opt._tensordict).

A transform over a TensorDict runs the same kernels on the same tensors as over the plain dict
of its entries, so results are compared bit for bit (rule 1).
"""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import torch
from conftest import assert_bitwise

import functional_opt as fo

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _td(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "w": torch.randn(4, 3, generator=g),
            "layer": {"b": torch.randn(2, generator=g), "v": torch.randn(2, 5, generator=g)},
        },
        batch_size=[],
    )


def _plain(x: Any) -> Any:
    """The tree with every TensorDict replaced by the dict of its entries."""
    return _as_dicts(x)


def _as_dicts(x: Any) -> Any:
    if isinstance(x, TensorDict):
        return {k: _as_dicts(x[k]) for k in x.keys()}  # noqa: SIM118 (iterating a TensorDict walks its batch)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_as_dicts(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_as_dicts(v) for v in x)
    if isinstance(x, dict):
        return {k: _as_dicts(v) for k, v in x.items()}
    return x


TRANSFORMS = [
    pytest.param(lambda: fo.adam(1e-2), id="adam"),
    pytest.param(lambda: fo.adamw(1e-2, weight_decay=0.1), id="adamw"),
    pytest.param(lambda: fo.sgd(0.1, momentum=0.9, nesterov=True), id="sgd"),
    pytest.param(lambda: fo.dreamerv3(lr=1e-2, warmup=0), id="dreamerv3"),
    pytest.param(lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adam(1e-2)), id="clip"),
    pytest.param(lambda: fo.MultiSteps(fo.adam(1e-2), every_k_schedule=2), id="multisteps"),
    pytest.param(lambda: fo.from_torch(torch.optim.AdamW, lr=1e-2), id="from_torch"),
]


@pytest.mark.parametrize("make", TRANSFORMS)
def test_transforms_on_tensordict(make: Any) -> None:
    """Updates, state and new params over a TensorDict are TensorDicts where the params are,
    and equal the run over plain dicts bit for bit; the state checkpoints through
    state_to_dict with weights_only=True."""
    tx = make()
    params = _td(0)
    plain = _plain(params)
    state, plain_state = tx.init(params), tx.init(plain)
    for step in range(3):
        grads = _td(10 + step)
        updates, state = tx.update(grads, state, params)
        plain_updates, plain_state = tx.update(_plain(grads), plain_state, plain)
        assert isinstance(updates, TensorDict) and isinstance(updates["layer"], TensorDict)
        params = fo.apply_updates(params, updates)
        plain = fo.apply_updates(plain, plain_updates)
        assert isinstance(params, TensorDict)
        assert_bitwise(_plain(params), plain)
        assert_bitwise(_plain(state), plain_state)
    assert any(isinstance(x, TensorDict) for x in _nodes(state))
    buffer = io.BytesIO()
    torch.save(fo.state_to_dict(state), buffer)
    buffer.seek(0)
    loaded = fo.state_from_dict(tx.init(params), torch.load(buffer, weights_only=True))
    assert fo.state_to_dict(loaded).keys() == fo.state_to_dict(plain_state).keys()
    assert_bitwise(_plain(loaded), _plain(state))


def _nodes(x: Any) -> list[Any]:
    out = [x]
    if isinstance(x, TensorDict):
        for k in x.keys():  # noqa: SIM118
            out += _nodes(x[k])
    elif isinstance(x, (tuple, list)):
        for v in x:
            out += _nodes(v)
    elif isinstance(x, dict):
        for v in x.values():
            out += _nodes(v)
    return out


def test_rebuilt_tensordicts_keep_batch_size_device_and_names() -> None:
    params = TensorDict(
        {"a": torch.zeros(3, 2), "n": TensorDict({"b": torch.ones(3)}, batch_size=[3])},
        batch_size=[3],
        device="cpu",
        names=["batch"],
    )
    tx = fo.adam(1e-2)
    state = tx.init(params)
    mu = state[0].mu
    assert isinstance(mu, TensorDict) and mu.batch_size == torch.Size([3])
    assert mu.device == torch.device("cpu") and mu.names == ["batch"]
    assert mu["n"].batch_size == torch.Size([3])
    new = fo.apply_updates(params, tx.update(params, state, params)[0])
    assert new.batch_size == torch.Size([3]) and new.names == ["batch"]
    # a state entry that does not fit the batch size (0-d step counts) gets an empty one
    steps = fo.from_torch(torch.optim.Adam).init(params).slots["step"]
    assert isinstance(steps, TensorDict) and steps.batch_size == torch.Size([])


def test_none_gradient_in_a_tensordict() -> None:
    """A TensorDict stores None as non-tensor data; the tree reads it back as a None leaf (no
    gradient: no update, state carried)."""
    params = _td(0)
    grads = _td(1)
    grads["w"] = None
    tx = fo.adam(1e-2)
    state = tx.init(params)
    updates, new_state = tx.update(grads, state, params)
    assert updates["w"] is None
    assert_bitwise(new_state[0].mu["w"], state[0].mu["w"])
    assert_bitwise(fo.apply_updates(params, updates)["w"], params["w"])


def test_functional_call_training_loop() -> None:
    """TensorDict.from_module params trained with torch.func.functional_call equal the same
    loop over a plain dict of the module's params, bit for bit."""
    model = _model()
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))

    def loss(params: Any) -> torch.Tensor:
        if isinstance(params, TensorDict):  # functional_call takes a dict of dotted names
            params = params.flatten_keys(".").to_dict()
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1))
    params = TensorDict.from_module(model).detach().clone()
    plain = {k: v.detach().clone() for k, v in model.named_parameters()}
    state, plain_state = tx.init(params), tx.init(plain)
    losses = []
    for _ in range(5):
        grads = torch.func.grad(loss)(params)
        assert isinstance(grads, TensorDict)
        updates, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        plain_grads = torch.func.grad(loss)(plain)
        plain_updates, plain_state = tx.update(plain_grads, plain_state, plain)
        plain = fo.apply_updates(plain, plain_updates)
        losses.append(float(loss(params)))
    assert_bitwise(dict(params.flatten_keys(".").items()), plain)
    assert losses[-1] < losses[0]
    with params.to_module(model):  # and the params load back into the module
        assert_bitwise(model(x), torch.func.functional_call(model, plain, (x,)))


def test_pack_a_tensordict() -> None:
    """pack() of a TensorDict keeps it as the packed tree's structure: updates over it equal
    the loose TensorDict's, and the fast apply over buffers gives the same params."""
    params = _td(0)
    packed = fo.pack(params)
    assert isinstance(packed.tree, TensorDict)
    tx = fo.adam(1e-2)
    state, loose_state = tx.init(packed), tx.init(params)
    grads = _td(1)
    updates, state = tx.update(fo.pack(grads), state, packed)
    loose_updates, loose_state = tx.update(grads, loose_state, params)
    assert_bitwise(_plain(updates.tree), _plain(loose_updates))
    new = fo.apply_updates(packed, updates)
    assert_bitwise(_plain(new.tree), _plain(fo.apply_updates(params, loose_updates)))


def test_mismatched_keys_name_the_path() -> None:
    params = _td(0)
    tx = fo.adam(1e-2)
    state = tx.init(params)
    grads = _td(1)
    del grads["layer", "v"]
    with pytest.raises(ValueError, match="layer"):
        tx.update(grads, state, params)


def test_registered_when_tensordict_is_imported_later(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """functional_opt never imports tensordict (seconds of import time): its import hook calls
    back once the package has run (here on a stand-in package), then leaves sys.meta_path."""
    from functional_opt._tensordict import _HOOK, _AfterImport

    assert _HOOK not in sys.meta_path  # tensordict is imported in this process: hook done
    package = tmp_path / "fo_standin_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("class TensorDict:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []
    hook = _AfterImport("fo_standin_pkg", lambda module: seen.append(module.TensorDict))
    hook.install()
    try:
        import fo_standin_pkg  # type: ignore[import-not-found]

        assert seen == [fo_standin_pkg.TensorDict]
        assert hook not in sys.meta_path
    finally:
        hook.uninstall()
        sys.modules.pop("fo_standin_pkg", None)
