"""The main job (examples/demo.py) runs end to end on a tiny budget and rejects bad options."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _demo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = module
    spec.loader.exec_module(module)
    return module


def test_demo_runs_and_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo = _demo()
    code = demo.main(["--steps", "12", "--hidden", "16", "--seq-len", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "final loss" in out and "agree" in out
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert {r["run"] for r in rows} == {
        "DreamerV3 adapter (bf16 autocast)",
        "DreamerV3 functional (torch.func)",
        "torch.optim.AdamW (fp32)",
    }
    assert len(rows) == 36


@pytest.mark.parametrize("args", [["--steps", "0"], ["--lr", "-1"], ["--warmup", "x"]])
def test_demo_rejects_bad_options(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _demo().parse_args(args)
    assert exc.value.code == 2
    assert "expected" in capsys.readouterr().err
