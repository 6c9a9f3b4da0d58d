"""scripts/bench_models.py (the harness of He et al. 2023's Table 2, arXiv 2305.15099): every model is measured at every
length with ratios to vanilla, the Fourier Transformer's filter cuts the FLOPs and memory,
and the paper's ratios sit beside ours at the paper's lengths. No timing is asserted."""

from jxformers.tools import bench_models

SMALL = {"num_layers": 1, "d_model": 16, "num_heads": 2, "ffn": {"d_ff": 32}}


def test_every_model_is_measured_and_the_filter_cuts_flops_and_memory():
    rows = bench_models.run(
        bench_models.models(["linear"]), (40,), batch=1, steps=1, repeats=1, model_size=SMALL, progress=False
    )
    by_model = {r.model: r for r in rows}
    assert list(by_model) == ["vanilla", "fourier_transformer", "linear"]
    assert all(r.step_s > 0 and r.flops > 0 and r.argument_bytes > 0 for r in rows)
    vanilla, fourier = by_model["vanilla"], by_model["fourier_transformer"]
    assert fourier.flops < 0.5 * vanilla.flops  # every block runs at 20% of the length
    assert fourier.temp_bytes < vanilla.temp_bytes
    assert fourier.argument_bytes == vanilla.argument_bytes  # the filter has no parameters


def test_table_shows_ratios_to_vanilla_next_to_the_paper():
    rows = [
        bench_models.Row("vanilla", 1024, 32, 2.0, 100e9, 300, 100),
        bench_models.Row("fourier_transformer", 1024, 32, 0.5, 10e9, 60, 20),
    ]
    text = bench_models.table(rows)
    fourier = next(line for line in text.splitlines() if "| fourier_transformer |" in line)
    cells = [c.strip() for c in fourier.split("|")[1:-1]]
    assert cells[4:6] == ["4.00", "6.9"] and cells[7:9] == ["0.20", "0.23"] and cells[10] == "0.100"


def test_main_writes_the_report_with_command_and_machine(tmp_path):
    out = tmp_path / "bench.md"
    sizes = ["--set", "num_layers=1", "--set", "d_model=16", "--set", "num_heads=2", "--set", "ffn.d_ff=32"]
    assert (
        bench_models.main(
            ["--lengths", "24", "--batch", "1", "--steps", "1", "--repeats", "1", *sizes, "--out", str(out)]
        )
        == 0
    )
    text = out.read_text()
    assert "Command: `python scripts/bench_models.py --lengths 24" in text and "Machine:" in text
    assert "| 24 | 1 | vanilla |" in text and "| 24 | 1 | fourier_transformer |" in text
    assert "'ffn': {'kind': 'gelu', 'd_ff': 32}" in text  # the dotted size merged into the component
