"""User-facing programs.

cli.py           the `jxformers` command (list, train, eval, generate, bench, compare, plot, ...)
bench.py         the attention benchmark (time, XLA FLOPs, memory against softmax)
bench_decode.py  the decoding benchmark (tokens/s against context length, per decoder)
bench_images.py  images/s of whole-image autoregressive generation
bench_models.py  the model-level benchmark (vanilla encoder against the Fourier Transformer)
compare.py       `jxformers compare`: one experiment trained once per attention
lra.py           `jxformers lra`: the Long Range Arena's tasks x attentions x seeds, LRA's table
describe.py      `jxformers describe` and `jxformers schema`: what each experiment key means
demo.py          `make demo`: softmax, linear-attention and Fourier-Transformer classifiers
plot.py          training curves of several runs in one PNG
help_text.py     command-line help drawn from module docstrings
"""
