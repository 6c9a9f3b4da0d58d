"""scripts/bench_attention_options.py (issue 30's overhead table): one row per option and
length, ratios against the plain attention of the same run; not the timing itself."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_attention_options as bench  # noqa: E402  (a script, importable once scripts/ is on the path)


def test_the_table_has_every_option_at_every_length(tmp_path):
    out = tmp_path / "options.md"
    bench.main(["--lengths", "16", "--repeats", "1", "--calls", "1", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 16 ")]
    assert len(rows) == len(bench.OPTIONS)
    plain = [r for r in rows if "| plain |" in r]
    assert all("| 1.00 |" in r and "| 1.000 |" in r for r in plain)  # the baseline against itself
    assert "Command: `python scripts/bench_attention_options.py --lengths 16 " in out.read_text()
    # an option adds FLOPs over the logits, never removes the attention's own; collaborative
    # heads share query/key projections of 128 in place of 4 x 64 = 256: fewer FLOPs
    for r in rows:
        ratio = float(r.split("|")[6])
        assert ratio < 1.0 if "| collaborative 128 |" in r else ratio >= 0.99, r
