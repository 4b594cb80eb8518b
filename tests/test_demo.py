"""The demo shows what it claims, reproducibly: unscaled fp16 stalls, ampscale tracks fp32."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ampscale import demo


def test_round_to_half_equals_numpy_float16() -> None:
    bits = np.arange(2**32, step=4093, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    with np.errstate(over="ignore"):  # values beyond float16's range become inf, as they should
        expected = values.astype(np.float16).astype(np.float32)
    got = demo.round_to_half_numpy(values)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert np.array_equal(np.isinf(got), np.isinf(expected))
    # every float16 value is a fixed point, and the rounding boundaries go the right way
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    ok = np.isfinite(halves)
    np.testing.assert_array_equal(demo.round_to_half_numpy(halves[ok]), halves[ok])


def test_unscaled_fp16_stalls_and_ampscale_tracks_fp32() -> None:
    runs = {mode: demo.train(mode, steps=400) for mode in demo.MODES}
    fp32, fp16, scaled = (runs[m].final_loss for m in demo.MODES)
    assert fp16 > 5 * fp32, "unscaled fp16 should stall well above fp32"
    assert scaled < 2 * fp32, "fp16 with ampscale should track fp32"
    assert runs["fp16 + ampscale"].skipped, "a 2**32 start must overflow and back off"


def test_runs_are_reproducible() -> None:
    first, again = (demo.train("fp16 + ampscale", steps=60) for _ in range(2))
    assert first.skipped  # the run backs off from 2**32: the scaler's path is part of what repeats
    assert again.losses == first.losses
    assert again.scales == first.scales


def test_demo_command_prints_table_and_saves_plot(tmp_path, capsys) -> None:
    out = tmp_path / "demo.png"
    assert demo.main(["--steps", "40", "--growth-interval", "7", "--init-scale", "1024", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    header = text.splitlines()[0]
    assert header.startswith("ampscale demo: MLP 32-128-512")
    # the header names the settings the run used, not the defaults
    for setting in ("40 steps", "backend numpy", "preset torch", "init scale 2^10", "growth interval 7"):
        assert setting in header
    assert "fp16 + ampscale" in text
    assert "final loss" in text
    if importlib.util.find_spec("matplotlib") is None:  # the demo extra is not installed
        assert "matplotlib is not installed: no plot (pip install 'ampscale[demo]')" in text
        return
    assert f"plot saved to {out}" in text
    assert out.stat().st_size > 10_000


def test_demo_rejects_bad_options(capsys) -> None:
    for steps in ("5", "19", "many"):
        with pytest.raises(SystemExit) as exit_info:
            demo.main(["--steps", steps])
        assert exit_info.value.code == 2
        assert "argument --steps: must be " in capsys.readouterr().err
    assert "at least 20" in demo.build_parser().format_help()
    with pytest.raises(SystemExit):
        demo.main(["--backend", "tensorflow"])


def test_plot_shows_every_run_and_the_settings(tmp_path, monkeypatch) -> None:
    """fp16 + ampscale follows fp32 closely: both lines must stay visible (different widths and
    styles, ampscale drawn on top), and the title names the settings that ran."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [demo.train(mode, steps=30) for mode in demo.MODES]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    args = demo.build_parser().parse_args(["--steps", "30"])
    demo._plot(runs, str(tmp_path / "plot.png"), demo.describe(args, separator="\n"))
    (figure,) = figures
    top = figure.axes[0]
    lines = {line.get_label().split(" (")[0]: line for line in top.get_lines()}
    fp32, scaled = lines["fp32"], lines["fp16 + ampscale"]
    assert fp32.get_linewidth() > 2 * scaled.get_linewidth()  # the wide line shows around the narrow one
    assert scaled.get_linestyle() != "-"  # and through its gaps
    assert scaled.get_zorder() > fp32.get_zorder()
    assert "init scale 2^32, growth interval 50" in top.get_title()
    assert "30 steps" in top.get_title()


@pytest.mark.parametrize("backend", ["torch", "jax", "cupy"])
def test_missing_framework_is_one_line_with_the_install_command(backend: str) -> None:
    from tests.numpy_only import run_numpy_only

    result = run_numpy_only(
        f"import sys\nfrom ampscale.__main__ import main\nsys.exit(main(['demo', '--backend', {backend!r}]))",
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert f"--backend {backend}" in line
    assert "is not installed" in line
    assert f"pip install 'ampscale[{backend}]'" in line


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_demo_on_other_backends_follows_the_numpy_run(backend: str) -> None:
    """``--backend torch|jax`` trains the same model with the same data: the same steps are
    skipped, the scale follows the same trajectory, the losses agree to rounding."""
    pytest.importorskip(backend)
    reference = demo.train("fp16 + ampscale", steps=150)
    run = demo.train("fp16 + ampscale", backend=backend, steps=150)
    assert run.skipped == reference.skipped
    assert run.scales == reference.scales
    np.testing.assert_allclose(run.losses, reference.losses, rtol=2e-2)
