"""The Fourier Transformer's analyses (He et al. 2023): the spectrum math in
`jxformers.ops.fourier` (`dct_power`, `cumulative_energy`, `energy_share`) against an
explicit DCT-II matrix, and scripts/fourier_keep_ratio.py's candidates and table on fake
rows (nothing is trained here; scripts/fourier_spectrum.py's page writing too)."""

import math
import pathlib
import sys

import numpy as np
import pytest

from jxformers import ops

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import fourier_keep_ratio  # noqa: E402  (a script, importable once scripts/ is on the path)
import fourier_spectrum  # noqa: E402


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II [k, n], written out (He et al. 2023, eq. 1-2)."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    alpha = np.where(k == 0, math.sqrt(1 / n), math.sqrt(2 / n))
    return alpha * np.cos(np.pi * k * (2 * i + 1) / (2 * n))


def test_dct_power_is_the_mean_squared_coefficient_over_the_other_axes():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 21, 5)).astype(np.float32)  # [windows, n, channels]
    coefficients = np.einsum("kn,wnd->wkd", dct_matrix(21), x)
    expected = (coefficients**2).mean(axis=(0, 2))
    np.testing.assert_allclose(ops.dct_power(x, axis=1), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ops.dct_power(x[0]), (coefficients[0] ** 2).mean(axis=1), rtol=1e-4, atol=1e-6)
    # Parseval: the powers sum to the mean squared norm along the sequence
    np.testing.assert_allclose(np.sum(expected), (x**2).sum(axis=1).mean(), rtol=1e-4)


def test_a_low_frequency_signal_puts_its_energy_in_the_lowest_bins():
    n, k0 = 40, 2
    wave = dct_matrix(n)[k0]  # the cosine of k0 half-periods
    amplitudes = np.random.default_rng(1).normal(size=(1, 6))  # every channel, its own amplitude
    x = (wave[:, None] * amplitudes).astype(np.float32)
    power = np.asarray(ops.dct_power(x))
    assert power[k0] / power.sum() > 0.999
    cumulative = np.asarray(ops.cumulative_energy(power))
    assert cumulative[k0 - 1] < 1e-3 and cumulative[-1] == pytest.approx(1.0)
    assert float(ops.energy_share(power, 0.1)) > 0.999  # ceil(0.1 * 40) = 4 bins hold k0 = 2
    assert float(ops.energy_share(power, 1 / n)) < 1e-3  # one bin: the mean only
    white = np.random.default_rng(2).normal(size=(n, 512)).astype(np.float32)
    assert float(ops.energy_share(ops.dct_power(white), 0.1)) == pytest.approx(0.1, abs=0.02)


def test_energy_share_counts_the_bins_the_filter_keeps_and_refuses_negative_power():
    flat = np.ones((2, 10), np.float32)
    np.testing.assert_allclose(ops.energy_share(flat, 0.25), [0.3, 0.3])  # ceil(2.5) = 3 of 10 bins
    with pytest.raises(ValueError, match="power must be >= 0"):
        ops.cumulative_energy(np.array([1.0, -2.0], np.float32))
    with pytest.raises(ValueError, match="keep_ratio"):
        ops.energy_share(flat, 0.0)


def test_keep_ratio_candidates_and_their_table():
    runs = fourier_keep_ratio.sweep([0.5, 0.1])
    assert runs == {
        "no filter": [],
        "r = 0.1": ["model.stack.filters={0: 0.1}"],
        "r = 0.5": ["model.stack.filters={0: 0.5}"],
    }
    assert fourier_keep_ratio.parse_args(["--seeds", "3", "--set", "preset=tiny"]).overrides == ["preset=tiny"]
    with pytest.raises(SystemExit):
        fourier_keep_ratio.parse_args(["--ratios", "0.2", "1.5"])

    def row(acc, speed):
        return {"eval_accuracy": acc, "steps_per_s": speed, "step_temp_mib": 8.0, "flops_per_token": 4e5}

    rows = {
        "no filter": [row(0.5, 10.0), row(0.7, 10.0)],
        "r = 0.1": [row(0.2, 30.0), row(0.2, 30.0)],
        "r = 0.5": [{"skipped": "does not build: no"}],
    }
    lines = fourier_keep_ratio.sweep_table(rows).splitlines()
    assert lines[2].startswith("| no filter | 0.600 ± 0.141 | 10.00 ± 0.00 | 1.00 | 8.0 | 1.00 |")
    assert lines[3].startswith("| r = 0.1 | 0.200 ± 0.000 | 30.00 ± 0.00 | 3.00 |")
    assert "skipped: does not build: no" in lines[4]
    alone = fourier_keep_ratio.sweep_table({"no filter": rows["r = 0.5"], "r = 0.1": rows["r = 0.1"]})
    assert alone.splitlines()[3] == "| r = 0.1 | 0.200 ± 0.000 | 30.00 ± 0.00 | - | 8.0 | - |"  # nothing to relate to


def test_a_generated_section_replaces_only_what_its_markers_hold(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- spectrum:start -->\nold\n<!-- spectrum:end -->\nmore\n")
    fourier_spectrum.write_section(page, "spectrum", "new table\n")
    assert page.read_text() == "intro\n<!-- spectrum:start -->\nnew table\n<!-- spectrum:end -->\nmore\n"
    with pytest.raises(ValueError, match="keep-ratio:start"):
        fourier_spectrum.write_section(page, "keep-ratio", "x")
