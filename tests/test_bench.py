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


def test_the_notes_speak_only_of_the_attentions_and_lengths_that_ran(tmp_path):
    # The notes under the table were one fixed text about every attention at N = 128 .. 8192
    # and the causal linear forms, whatever the run measured.
    out = tmp_path / "bench.md"
    assert cli.main(["bench", "--names", "local", "--lengths", "32", *TINY, "--out", str(out)]) == 0
    text = out.read_text()
    notes = " ".join(text[text.index("### Reading the table") :].split())  # unwrapped
    assert "`local` with window w computes" in notes and "GFLOP at N = 32 with these shapes" in notes
    for absent in ("bigbird", "chunked", "synthesizer", "Performer", "RFA", "8192", "4096", "N = 512", "scan"):
        assert absent not in notes, absent
    assert "Kernelized" not in notes and "Causal linear attention" not in notes


def _notes(*args, **kwargs) -> str:
    return " ".join(bench.notes(*args, **kwargs).split())  # unwrapped


def test_each_claim_of_the_notes_needs_its_attentions_lengths_and_forms():
    shapes = dict(batch=2, heads=4, d=64)
    everything = _notes(bench.registry.names(), bench.FULL_LENGTHS, form_lengths=(256, 1024, 4096), **shapes)
    assert "137 GFLOP at N = 8192" in everything and 'The target "chunked 5x faster' in everything
    assert "`local`, `longformer`, `bigbird` and `chunked` are as slow" in everything
    some = _notes(["softmax", "bigbird", "rfa"], (512, 1024), **shapes)
    assert "the matrix, and `bigbird` are as slow" in some and "`local`" not in some  # only the one that ran
    assert "RFA's forward wins from N = 1024" in some and "Performer" not in some and "Linear attention" not in some
    assert "Loops are counted once" not in some and "Causal linear attention" not in some
    assert "N = 1024" not in _notes(["softmax", "rfa"], (512,), **shapes)  # a length not run is not quoted
    forms = _notes(["softmax"], (64,), form_lengths=(256,), **shapes)
    assert "Causal linear attention" in forms and "N = 4096" not in forms
    assert _notes(["softmax"], (64,), **shapes).count("* **") == 1  # the dense FLOP floor alone


def test_the_loop_footnote_and_the_decoding_notes_speak_only_of_what_ran():
    rows = [bench.Row("softmax", 64, 1.0, 1.0, 1.0, 1), bench.Row("linear scan", 64, 1.0, 1.0, 1.0, 1, loops=True)]
    assert "counts a loop body once" in bench.table(rows) and "chunked" not in bench.table(rows)
    from jxformers.tools import bench_decode

    short = " ".join(bench.render_notes(bench_decode.NOTES, [], (256, 512)).split())
    assert "Per-step cost" in short and "Table 1 of Katharopoulos et al. 2020" in short
    assert "8192" not in short and "4096" not in short and "2048" not in short
    full = " ".join(bench.render_notes(bench_decode.NOTES, [], bench_decode.FULL_LENGTHS).split())
    assert "16 MiB of cache at N = 8192" in full and "about 12x at 8192" in full
