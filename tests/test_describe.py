"""`jxformers describe` and `jxformers schema`: every key documented where it is declared,
and the schema accepts every shipped experiment (each preset merged) and refuses keys
that do not exist or sit on the wrong component."""

import json
import pathlib

import jsonschema
import pytest
import yaml

from jxformers.tools import cli
from jxformers.tools.describe import all_keys, describe, schema
from jxformers.train.experiment import EXPERIMENTS_DIR, deep_merge


def test_a_key_of_a_union_component_is_described_per_kind():
    text = describe("model.ffn.top_k")
    assert "model.ffn.top_k: int = 1  [ffn kind moe]" in text and "model.ffn.top_k: int = 8  [ffn kind pkm]" in text
    assert "experts per token" in text
    assert "one of ['adamw', 'radam']" in describe("train.optimizer")
    with pytest.raises(ValueError, match="no experiment key 'train.stepz'"):
        describe("train.stepz")


def test_every_key_has_a_doc():
    assert not [k.path for k in all_keys() if not k.doc]


def test_the_commands(capsys):
    assert cli.main(["describe", "model.stack.mem_len"]) == 0
    out = capsys.readouterr().out
    assert "[stack kind transformer_xl]" in out and "[stack kind compressive]" in out
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "jxformers experiment"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_the_schema_accepts_every_shipped_experiment(path: pathlib.Path):
    config = yaml.safe_load(path.read_text())
    validator = jsonschema.Draft202012Validator(schema())
    validator.validate(config)
    for preset in (config.get("presets") or {}).values():
        validator.validate(deep_merge({k: v for k, v in config.items() if k != "presets"}, preset or {}))


@pytest.mark.parametrize(
    "bad",
    [
        {"train": {"stepz": 10}},
        {"model": {"stack": {"kind": "transformer", "mem_len": 4}}},
        {"model": {"ffn": {"kind": "gelu", "num_experts": 2}}},
        {"model": {"norm": {"placement": "middle"}}},
        {"mesh": {"data": "two"}},
    ],
)
def test_the_schema_refuses_what_the_config_refuses(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema())
