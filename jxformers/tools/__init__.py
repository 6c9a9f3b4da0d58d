"""User-facing programs: the `jxformers` command (`cli`), the attention and decoding
benchmarks (`bench`, `bench_decode`), the demo, plots, the XLA cost helper that the
benchmarks, the tests and the train loop share (`xla_cost`), and help text drawn from
docstrings (`help_text`)."""
