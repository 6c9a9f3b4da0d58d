"""scripts/depth_study.py (issue 31's depth table): its arguments (`--layers`, `--norms`,
`--only`) and the rows they make, without training anything."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import depth_study  # noqa: E402  (a script, importable once scripts/ is on the path)

from jxformers.nn import residual  # noqa: E402


def test_every_placement_has_a_row():
    placements = {o.split("=")[1] for rows in depth_study.VARIANTS.values() for o in rows if "placement" in o}
    assert placements == set(residual.PLACEMENTS)


def test_layers_and_norms_make_the_rows_asked_for():
    args = depth_study.parse_args(
        ["--layers", "4", "12", "24", "--only", "pre", "admin", "--norms", "layernorm", "scalenorm"]
    )
    assert args.depths == [4, 12, 24]
    rows = depth_study.variants(args.only, args.norms)
    assert list(rows) == ["pre", "pre, scalenorm", "admin", "admin, scalenorm"]
    assert rows["pre, scalenorm"] == ["model.norm.placement=pre", "model.norm.kind=scalenorm"]
    assert depth_study.parse_args(["--depths", "8"]).depths == [8]  # the earlier spelling
    # rows that name their kind keep it; no --norms: the rows as listed
    assert depth_study.variants(["post, adanorm"], ["scalenorm"]) == {
        "post, adanorm": depth_study.VARIANTS["post, adanorm"]
    }
    assert depth_study.variants(None, None) == depth_study.VARIANTS


@pytest.mark.parametrize(
    "argv", [["--layers", "0"], ["--norms", "batchnorm"], ["--only", "skipinit"], ["--seeds", "0"]]
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        depth_study.parse_args(argv)
