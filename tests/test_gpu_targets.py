"""scripts/gpu_targets.py reads the GPU benchmarks' tables into the kernel issue's
targets: met, missed, or not measured, with ratios taken within one table."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_targets  # noqa: E402

HEADER = (
    "| N | d | pattern | impl | visited | fwd ms | fwd TFLOP/s (visited / dense) | fwd+bwd ms | "
    "fwd+bwd TFLOP/s (visited / dense) |\n|---|---|---|---|---|---|---|---|---|\n"
)


def statuses(text, percent=None):
    return {name: (value, met) for name, value, met in gpu_targets.targets(gpu_targets.read_rows(text), percent)}


def test_ratios_and_verdicts_from_a_table():
    text = HEADER + (
        "| 8192 | 128 | dense | pallas | 1.000 | 4.0 | x / x | 20.0 | x / x |\n"
        "| 8192 | 128 | dense | dot_product_attention cudnn | 1.000 | 3.6 | x / x | 15.0 | x / x |\n"
        "| 8192 | 128 | longformer w256 g2 | pallas | 0.100 | 0.5 | x / x | 2.0 | x / x |\n"
    )
    got = statuses(text, percent=60)
    assert got["dense forward at 8K >= 0.8x cuDNN"] == ("0.90x", True)
    assert got["dense forward+backward at 8K >= 0.7x cuDNN"] == ("0.75x", True)
    # 0.5 ms over 0.1 of the blocks is 5 ms per dense-equivalent, 1.25x the dense kernel's 4
    assert got["longformer w256 g2 at 8192: time per visited block <= 1.3x the dense kernel's"] == ("1.25x", True)
    assert got["causal window 512 at 16K >= 12x faster than dense causal (same kernel)"] == ("not measured", None)
    assert got["MoE grouped matmul >= 50% of a dense matmul"] == ("60%", True)


def test_the_committed_h100_tables(capsys):
    gpu_targets.main([str(ROOT / "docs/kernel_runs/h100_mosaic.md"), str(ROOT / "docs/moe_runs/gpu.md")])
    out = capsys.readouterr().out
    assert "MISSED  dense forward at 8K >= 0.8x cuDNN: 0.77x" in out
    assert "MISSED  MoE grouped matmul >= 50% of a dense matmul: 13%" in out
    assert "-       linear attention at 16K forward <= 1.25x flash-linear-attention's time: not measured" in out


def test_a_table_without_kernel_rows_is_skipped(tmp_path, capsys):
    # The campaign passes every table it wrote, the models benchmark's among them.
    models = tmp_path / "models.md"
    models.write_text("| N | batch | model | step s |\n|---:|---:|---|---:|\n| 1024 | 32 | vanilla | 0.110 |\n")
    assert gpu_targets.read_rows(models.read_text()) == []
    gpu_targets.main([str(models), str(ROOT / "docs/kernel_runs/h200_flash.md")])
    out = capsys.readouterr().out
    assert "MISSED  dense forward at 8K >= 0.8x cuDNN: 0.77x" in out
