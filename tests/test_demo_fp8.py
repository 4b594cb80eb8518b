"""The demo's FP8 runs (``python -m ampscale demo --fp8``): bf16, and bf16 with FP8 products
under delayed and current scaling, on the CPU with emulated casts."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ampscale import demo

ml_dtypes = pytest.importorskip("ml_dtypes")


def test_round_to_bfloat16_equals_ml_dtypes() -> None:
    bits = np.arange(2**32, step=4093, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([bits.view(np.float32), np.float32([np.inf, -np.inf, 3.3895314e38, 0.0, -0.0])])
    with np.errstate(over="ignore", invalid="ignore"):  # nan payloads and overflows, compared below
        expected = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = demo.round_to_bfloat16_numpy(values)
    nan = np.isnan(expected)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == expected[~nan].view(np.uint32)).all()


def test_fp8_runs_train_and_follow_bf16() -> None:
    """FP8 products cost precision (E4M3 keeps 3 mantissa bits) but train: every run learns,
    delayed and current scaling land close to each other, the loss falls to a tenth of its start and below."""
    runs = {mode: demo.train(mode, steps=120) for mode in demo.FP8_MODES}
    start = runs["bf16"].losses[0]
    for mode, run in runs.items():
        assert run.final_loss < start / 10, mode
        assert not run.skipped, mode
    delayed, current = runs["bf16 + fp8 delayed"].final_loss, runs["bf16 + fp8 current"].final_loss
    assert 0.5 < delayed / current < 2.0
    assert runs["bf16"].final_loss <= delayed  # the casts are not free
    assert runs["bf16 + fp8 delayed"].losses != runs["bf16"].losses


def test_the_fp8_runs_are_reproducible() -> None:
    first, again = (demo.train("bf16 + fp8 delayed", steps=30) for _ in range(2))
    assert first.losses == again.losses


def test_demo_with_fp8_prints_the_runs_and_plots_them(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "demo.png"
    assert demo.main(["--fp8", "--steps", "30", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp8: te_delayed (history 16), te_current" in text.splitlines()[0]
    for mode in demo.FP8_MODES:
        assert mode in text
    if importlib.util.find_spec("matplotlib") is None:
        return
    assert out.stat().st_size > 10_000
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    runs = [demo.train(mode, steps=20) for mode in (*demo.MODES, *demo.FP8_MODES)]
    args = demo.build_parser().parse_args(["--steps", "20", "--fp8"])
    demo._plot(runs, str(tmp_path / "plot.png"), demo.describe(args, separator="\n"))
    (figure,) = figures
    assert len(figure.axes) == 3
    labels = [line.get_label().split(" (")[0] for line in figure.axes[1].get_lines()]
    assert labels == ["fp32", *demo.FP8_MODES]
    assert [line.get_label().split(" (")[0] for line in figure.axes[0].get_lines()] == list(demo.MODES)


def test_fp8_refuses_cupy_in_one_line(capsys) -> None:
    assert demo.main(["--fp8", "--backend", "cupy"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--fp8 cannot run here: the FP8 runs train with --backend numpy, torch or jax" in line
