"""`jxformers bench`: every flag explained, --causal never runs an attention
bidirectionally under a causal heading, and loop-counted FLOPs are footnoted."""

import argparse

import pytest

from jxformers.tools import bench, cli

TINY = ["--batch", "1", "--heads", "1", "--dim", "8", "--repeats", "1"]


def test_every_bench_flag_has_help_text():
    actions = [a for a in bench.parser()._actions if not isinstance(a, argparse._HelpAction)]
    missing = [a.dest for a in actions if not a.help or a.help == argparse.SUPPRESS]
    assert not missing


def test_bench_help_describes_it_in_whole_sentences():
    # The description is the docstring's first paragraph, not its first line cut mid-sentence.
    text = " ".join(bench.parser().description.split())
    assert text.endswith("(ratios hold on a noisy shared machine; absolute times only on the machine named).")
    assert text.startswith("Attention benchmark: forward and forward+backward time")


def test_causal_bench_refuses_a_named_attention_that_cannot_be_causal(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--causal", "--names", "local", "bigbird", "--lengths", "32", *TINY])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bigbird cannot be causal" in err and "softmax" in err


def test_causal_bench_leaves_out_the_attentions_that_cannot_be_causal():
    kept, left_out = bench.causal_names(["softmax", "local", "bigbird", "linformer"], named=False)
    assert kept == ["softmax", "local"] and left_out == ["bigbird", "linformer"]


def test_causal_bench_table_names_what_it_left_out(tmp_path, monkeypatch):
    everything = bench.registry.names
    # "all registered" shortened to three, to keep the test fast
    monkeypatch.setattr(bench.registry, "names", lambda **kw: everything(**kw) if kw else ["softmax", "local", "fnet"])
    out = tmp_path / "bench.md"
    assert cli.main(["bench", "--causal", "--lengths", "32", *TINY, "--out", str(out)]) == 0
    text = out.read_text()
    assert "(causal)" in text and "| 32 | local |" in text and "| 32 | fnet |" not in text
    assert "Left out (they cannot be causal): fnet." in text


def test_loop_counted_flops_are_footnoted():
    # 64 tokens in chunks of 16: a real loop (with one chunk XLA removes the loop).
    entries = [bench.Entry("softmax", "softmax"), bench.Entry("chunked", "chunked", (("chunk_size", 16),))]
    rows = bench.run(entries, (64,), batch=1, heads=1, d=8, repeats=1, progress=False)
    text = bench.table(rows)
    assert [r.loops for r in rows] == [False, True]
    chunked_row = next(line for line in text.splitlines() if "| chunked |" in line)
    assert bench.LOOP_MARK in chunked_row and "counts a loop body once" in text
    assert bench.LOOP_MARK not in next(line for line in text.splitlines() if "| softmax |" in line)
