"""The demo shows what it claims, reproducibly: unscaled fp16 stalls, ampscale tracks fp32."""

from __future__ import annotations

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
    again = demo.train("fp16 + ampscale", steps=400)
    assert again.losses == runs["fp16 + ampscale"].losses  # seeded: reproducible


def test_demo_command_prints_table_and_saves_plot(tmp_path, capsys) -> None:
    out = tmp_path / "demo.png"
    assert demo.main(["--steps", "40", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp16 + ampscale" in text
    assert "final loss" in text
    assert f"plot saved to {out}" in text
    assert out.stat().st_size > 10_000


def test_demo_rejects_bad_options(capsys) -> None:
    assert demo.main(["--steps", "5"]) == 2
    with pytest.raises(SystemExit):
        demo.main(["--backend", "tensorflow"])


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
