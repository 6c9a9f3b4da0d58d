"""The command line and the registry table, as a user reaches them."""

import subprocess
import sys

from jxformers import registry
from jxformers.tools import cli

ISSUE_NAMES = [
    "softmax",
    "chunked",
    "local",
    "block_local",
    "dilated",
    "sparse_transformer",
    "longformer",
    "bigbird",
    "axial",
    "memory_compressed",
]


def test_registry_holds_the_exact_and_fixed_pattern_zoo():
    assert set(ISSUE_NAMES) <= set(registry.names())
    for name in registry.names():
        spec = registry.get(name)
        assert all(
            isinstance(getattr(spec, f), bool)
            for f in ("supports_causal", "decodes", "supports_kv_mask", "supports_cross", "takes_bias")
        )


def test_list_prints_every_attention(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in registry.names():
        assert name in out
    assert "causal" in out and "complexity" in out and "models" in out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "lm seq2seq +decode" in rows["performer"] and "recurrent" in rows["performer"]
    assert "lm" not in rows["nystrom"] and "classify retrieval" in rows["nystrom"]
    assert "lm seq2seq" in rows["block_local"] and "+decode" not in rows["block_local"]


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "jxformers.tools.cli", "list"], capture_output=True, text=True, check=True
    )
    assert "bigbird" in out.stdout


def test_unknown_command_fails_with_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_bench_writes_a_table_with_the_command_and_machine(tmp_path, capsys):
    out = tmp_path / "bench.md"
    code = cli.main(
        [
            "bench",
            "--lengths",
            "64",
            "--names",
            "local",
            "--batch",
            "1",
            "--heads",
            "2",
            "--dim",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    text = out.read_text()
    assert "Command: `jxformers bench --lengths 64" in text and "Machine:" in text
    assert "| 64 | softmax |" in text and "| 64 | local |" in text


def test_bench_refuses_an_unknown_attention_with_the_list_of_names(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--names", "perfomer"])
    assert exit_info.value.code == 2
    assert "registered: softmax" in capsys.readouterr().err


def test_short_sequence_and_checkpoint_warnings_are_one_line_said_once(capsys, monkeypatch):
    import warnings

    from jxformers import ShortSequenceWarning
    from jxformers.train.checkpoint import CheckpointWarning

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored afterwards
    cli._one_line_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(3):  # as when every evaluation builds the model again
            warnings.warn("nystrom at max_len 16 is dense", ShortSequenceWarning, stacklevel=1)
        warnings.warn("checkpoint 12 is damaged", CheckpointWarning, stacklevel=1)
    assert capsys.readouterr().err.splitlines() == [
        "jxformers: warning: nystrom at max_len 16 is dense",
        "jxformers: warning: checkpoint 12 is damaged",
    ]
