"""Adaptive computation (Lin et al. 2021, "A Survey of Transformers", section 6.3): stacks
that spend a different depth on each token or example, each the one element of an
`Encoder`'s or `LanguageModel`'s blocks, with its own decoding state.

* `UniversalStack`: the Universal Transformer (Dehghani, Gouws, Vinyals, Uszkoreit &
  Kaiser 2019, "Universal Transformers"): one shared step of transformer blocks applied
  recurrently, the coordinate embedding (position and step sinusoids) added before each
  step, and per-position adaptive computation time (Graves 2016, "Adaptive Computation
  Time for Recurrent Neural Networks") as the authors' tensor2tensor code computes it
  (`act_update`): halting probabilities, remainders, update weights, threshold 1 - ε and a
  step limit; the ponder cost N + R is a layer loss.
* `GatedStack`: conditional computation by gated sub-layers (Bapna, Arivazhagan & Firat
  2020, "Controlling Computation versus Quality for Neural Sequence Models", CCT): a
  control network per sub-layer gives each token a gate, noised and continuous in
  training, discrete (skip or run) at inference, conditioned on a computation budget, with
  a budget loss.
* `ExitStack`: early exit. A classifier after every block (the model's readout, which the
  model passes in as `readout`); in training the exits' losses are weighted (Elbayad, Gu,
  Grave & Auli 2020, "Depth-Adaptive Transformer": aligned or mixed training; Zhou et al.
  2020, "BERT Loses Patience: Fast and Robust Inference with Early Exit", PABEE: weights
  j / sum j); at inference a token (a language model, with its states copied upward) or an
  example (a classifier) leaves at the first block whose exit is confident enough
  (`confidence_exit`) or, PABEE, whose prediction has not changed for `patience` blocks
  (`patience_exit`).

Each reports the depth it used as a tally (`Produced.tallies`: "act_steps", "cct_depth",
"exit_depth"), which the train step logs and evaluation averages. In JAX every step and
block still runs (a halted, skipped or exited token's result is selected away), so the
depth saved is reported, not the time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from jxformers.nn.blocks import Block
from jxformers.nn.layers import Linear, normalise
from jxformers.nn.positions import sinusoidal
from jxformers.nn.produced import Exits, Produced

# How a Universal Transformer's ACT combines the steps' states into its output (both are
# tensor2tensor's act types): accumulated, Graves's sum_n w_n T_n ("accumulated");
# interpolated, s_n = w_n T_n + (1 - w_n) s_{n-1} ("basic", its precedence slip fixed).
ACT_STATES = ("accumulated", "interpolated")
STEP_EMBEDDINGS = ("sinusoidal", "learned")
EXIT_RULES = ("confidence", "patience")
EXIT_TRAININGS = ("aligned", "mixed", "weighted")

Readout = Callable[[int, Array, Any], Array]


def tally(total, count) -> Array:
    """A `Produced.tallies` value: (sum, count) as float32, whose ratio is the mean logged."""
    return jnp.stack([jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32)])


def _split(key, n):
    return [None] * n if key is None else list(jax.random.split(key, n))


# ----------------------------------------------------------------------------- ACT


def act_update(p, halting, remainders, n_updates, halted, threshold: float):
    """One step of adaptive computation time per position, as tensor2tensor's
    `universal_transformer_act` computes it, with `halted` kept as a flag (tensor2tensor
    tests halting < 1.0, which rounding can miss):

        running     = not halted
        new_halted  = running and halting + p > threshold
        still       = running and halting + p <= threshold
        halting    += p still;   remainders += new_halted (1 - halting);   halting += new_halted remainders
        n_updates  += still + new_halted
        w           = p still + new_halted remainders

    Arguments: p, halting, remainders, n_updates `[n]` float32, halted `[n]` bool,
    threshold 1 - ε. Returns (halting, remainders, n_updates, halted, w), each `[n]`."""
    running = (~halted).astype(jnp.float32)
    total = halting + p * running
    new_halted = (total > threshold).astype(jnp.float32) * running
    still = (total <= threshold).astype(jnp.float32) * running
    halting = halting + p * still
    remainders = remainders + new_halted * (1.0 - halting)
    halting = halting + new_halted * remainders
    n_updates = n_updates + still + new_halted
    weight = p * still + new_halted * remainders
    return halting, remainders, n_updates, halted | (new_halted > 0), weight


class UniversalStack(eqx.Module):
    """The Universal Transformer's recurrent stack (Dehghani et al. 2019).

    Step t (0-based, at most `max_steps`) reads s_t + P_t, P_t the coordinate embedding
    (the position's sinusoid, `position_signal`, plus step t's embedding: a sinusoid of t,
    the paper's, or a learned vector, tensor2tensor's default), and applies the shared
    `blocks` to it: T_t = blocks(s_t + P_t), s_{t+1} = T_t. With `act`, each position's
    halting unit p_t = sigmoid(w . (s_t + P_t) + b) (b starts at `halting_bias`) drives
    `act_update`; the output is sum_t w_t T_t ("accumulated") or the interpolation
    o_t = w_t T_t + (1 - w_t) o_{t-1} ("interpolated"), o_{-1} = 0; a position whose
    probabilities never pass the threshold stops at `max_steps` with no remainder (as the
    tensor2tensor loop ends). The ponder cost `ponder_weight` * mean over real positions of
    (N + R) is a layer loss ("ponder_loss"), and N, the steps each real position took, a
    tally ("act_steps"). Without `act`, `max_steps` steps and the last state.

    Halting is per position and reads only that position's state, so it is causal: a
    decoding step runs its token through every step against each step's cache (a halted
    position's later states are what later tokens attend, as in the parallel forward).
    """

    blocks: tuple[Block, ...]
    halting: Linear | None
    step_table: Float[Array, "steps d_model"] | None
    max_steps: int = eqx.field(static=True)
    threshold: float = eqx.field(static=True)
    ponder_weight: float = eqx.field(static=True)
    act_state: str = eqx.field(static=True)
    position_signal: bool = eqx.field(static=True)

    def __init__(
        self,
        blocks: list[Block],
        *,
        d_model: int,
        max_steps: int,
        act: bool = True,
        threshold: float = 0.99,
        ponder_weight: float = 0.01,
        halting_bias: float = 1.0,
        act_state: str = "accumulated",
        step_embedding: str = "sinusoidal",
        position_signal: bool = True,
        key: PRNGKeyArray,
    ):
        if act_state not in ACT_STATES or step_embedding not in STEP_EMBEDDINGS:
            raise ValueError(
                f"act_state in {ACT_STATES} and step_embedding in {STEP_EMBEDDINGS}; got {act_state=}, "
                f"{step_embedding=}"
            )
        if max_steps < 1 or not 0 < threshold <= 1:
            raise ValueError(f"max_steps >= 1 and threshold in (0, 1]; got {max_steps=}, {threshold=}")
        kh, ks = jax.random.split(key)
        self.blocks = tuple(blocks)
        halting = Linear(d_model, 1, key=kh) if act else None
        self.halting = None if halting is None else eqx.tree_at(lambda h: h.bias, halting, jnp.full((1,), halting_bias))
        self.step_table = jax.random.normal(ks, (max_steps, d_model)) if step_embedding == "learned" else None
        self.max_steps, self.threshold, self.ponder_weight = max_steps, float(threshold), float(ponder_weight)
        self.act_state, self.position_signal = act_state, position_signal

    def _signal(self, positions, dim: int) -> Float[Array, "steps n dim"]:
        """P_t for every step: `[max_steps, n, d]` (positions `[n]`, whole numbers)."""
        steps = jnp.arange(self.max_steps)
        step = sinusoidal(steps, dim) if self.step_table is None else self.step_table
        out = jnp.broadcast_to(step[:, None, :], (self.max_steps, positions.shape[0], dim))
        if self.position_signal:
            out = out + sinusoidal(positions.astype(jnp.int32), dim)[None]
        return out

    def _combine(self, out, transformed, weight):
        w = weight[:, None].astype(transformed.dtype)
        if self.act_state == "accumulated":
            return out + w * transformed
        return w * transformed + (1 - w) * out

    def _step_loop(self, x, signal, run_blocks, mask):
        """The steps over x `[n, d]`: (output, n_updates, remainders, ys of run_blocks)."""
        n = x.shape[0]
        zeros = jnp.zeros((n,), jnp.float32)
        carry0 = (x, zeros, zeros, zeros, jnp.zeros((n,), bool), jnp.zeros_like(x))

        def body(carry, xs):
            state, halting, remainders, n_updates, halted, out = carry
            signal_t, extra = xs
            s = state + signal_t.astype(state.dtype)
            transformed, ys = run_blocks(s, extra)
            if self.halting is None:
                return (transformed, halting, remainders, n_updates + 1, halted, transformed), ys
            p = jax.nn.sigmoid(self.halting(s)[:, 0].astype(jnp.float32))
            halting, remainders, n_updates, halted, w = act_update(
                p, halting, remainders, n_updates, halted, self.threshold
            )
            return (transformed, halting, remainders, n_updates, halted, self._combine(out, transformed, w)), ys

        return body, carry0

    def apply(
        self,
        x: Float[Array, "seq d_model"],
        *,
        kv_mask: Bool[Array, " seq"] | None = None,
        bias: Any = None,
        positions: Real[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        readout: Readout | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """Arguments as `Block.apply_maps`'s (`readout` unused). Returns `([seq, d_model],
        Produced)`: the ponder loss (with ACT), the "act_steps" tally and the blocks'
        layer losses (summed over the steps)."""
        del readout
        n = x.shape[0]
        positions = jnp.arange(n) if positions is None else positions
        signal = self._signal(positions, x.shape[-1])
        keys = None if key is None else jax.random.split(key, self.max_steps)

        def run_blocks(s, k):
            made = Produced()
            for i, (block, kb) in enumerate(zip(self.blocks, _split(k, len(self.blocks)), strict=True)):
                s, more = block.apply(
                    s, kv_mask=kv_mask, bias=bias, positions=positions, token_ids=token_ids, key=kb,
                    inference=inference,
                )  # fmt: skip
                made = made + more.under("blocks", i)
            return s, made.layer_losses

        body, carry0 = self._step_loop(x, signal, run_blocks, kv_mask)
        (last, _, remainders, n_updates, _, out), losses = jax.lax.scan(body, carry0, (signal, keys))
        real = jnp.ones((n,), jnp.float32) if kv_mask is None else kv_mask.astype(jnp.float32)
        count = jnp.maximum(real.sum(), 1.0)
        produced = Produced(
            layer_losses={name: v.sum() for name, v in losses.items()},
            tallies={"act_steps": tally((n_updates * real).sum(), real.sum())},
        )
        if self.halting is None:
            return last, produced
        ponder = self.ponder_weight * ((n_updates + remainders) * real).sum() / count
        return out, produced + Produced(layer_losses={"ponder_loss": ponder})

    def init_decode_state(self, max_len: int, dtype) -> dict[str, Any]:
        """Every step's caches of every block (stacked over the steps) and the position."""
        one = tuple(b.init_decode_state(max_len, dtype) for b in self.blocks)
        caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (self.max_steps, *a.shape)), one)
        return {"caches": caches, "length": jnp.zeros((), jnp.int32)}

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: dict[str, Any],
        *,
        bias_fn: Any = None,
        token_id: Int[Array, ""] | None = None,
        readout: Readout | None = None,
    ) -> tuple[Float[Array, " d_model"], dict[str, Any]]:
        """One token through every step, each against its own caches."""
        del readout
        signal = self._signal(state["length"][None], x.shape[-1])

        def run_blocks(s, caches):
            h, new = s[0], []
            for block, cache in zip(self.blocks, caches, strict=True):
                h, cache = block.decode_step(h, cache, bias_fn=bias_fn, token_id=token_id)
                new.append(cache)
            return h[None], tuple(new)

        body, carry0 = self._step_loop(x[None], signal, run_blocks, None)
        (last, *_, out), caches = jax.lax.scan(body, carry0, (signal, state["caches"]))
        y = (last if self.halting is None else out)[0]
        return y, {"caches": caches, "length": state["length"] + 1}


# ----------------------------------------------------------------------------- CCT


class Controller(eqx.Module):
    """A CCT control network for one sub-layer: the gate's logit
    l = u . relu(W x + e_b) + c of the token's state x and the budget b's embedding e_b."""

    hidden: Linear
    budget_table: Float[Array, "budgets hidden"]
    out: Linear

    def __init__(self, d_model: int, d_control: int, budgets: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.hidden, self.out = Linear(d_model, d_control, key=k1), Linear(d_control, 1, key=k2)
        self.budget_table = 0.02 * jax.random.normal(k3, (budgets, d_control))

    def __call__(self, x: Float[Array, "seq d_model"], budget: Int[Array, ""]) -> Float[Array, " seq"]:
        h = self.hidden(x.astype(jnp.float32)) + self.budget_table[budget][None]
        return self.out(jax.nn.relu(h))[:, 0]


def gate(logits: Float[Array, " seq"], *, noise: float, key, inference: bool) -> Float[Array, " seq"]:
    """CCT's gate: sigmoid(l + noise * N(0, 1)) in training (sigmoid(l) without a key),
    the discrete 1[l > 0] at inference."""
    if inference:
        return (logits > 0).astype(jnp.float32)
    if key is not None and noise:
        logits = logits + noise * jax.random.normal(key, logits.shape)
    return jax.nn.sigmoid(logits)


class GatedStack(eqx.Module):
    """Pre-norm transformer blocks whose self-attention and FFN sub-layers are gated per
    token (CCT, Bapna et al. 2020): x + g f(N(x)), g from `gate` of the sub-layer's
    `Controller` on x and the budget. In training each example draws its budget among
    `budgets` (the multi-task training over budgets); at inference it is `budget`. The
    budget loss `budget_weight` (mean over real tokens and sub-layers of g - b)^2 is a layer
    loss ("budget_loss"), and the layers used (executed sub-layers / 2 per real token) a
    tally ("cct_depth"). A skipped attention still writes its token's keys and values, so
    later tokens read them as in the parallel forward."""

    blocks: tuple[Block, ...]
    controllers: tuple[tuple[Controller, Controller], ...]
    budgets: tuple[float, ...] = eqx.field(static=True)
    budget: int = eqx.field(static=True)  # the index of the inference budget
    budget_weight: float = eqx.field(static=True)
    noise: float = eqx.field(static=True)

    def __init__(
        self,
        blocks: list[Block],
        *,
        d_model: int,
        budgets: tuple[float, ...],
        budget: float,
        budget_weight: float = 1.0,
        noise: float = 1.0,
        d_control: int = 16,
        key: PRNGKeyArray,
    ):
        if budget not in budgets:
            raise ValueError(f"budget must be one of the training budgets {budgets}; got {budget}")
        for block in blocks:
            if block.placement != "pre" or block.ffn is None or block.cross_attention is not None:
                raise ValueError(
                    "gated sub-layers skip to the residual stream: pre-norm blocks with an FFN and no "
                    f"cross-attention; got placement {block.placement!r}"
                )
        keys = jax.random.split(key, 2 * len(blocks))
        self.blocks = tuple(blocks)
        self.controllers = tuple(
            (Controller(d_model, d_control, len(budgets), key=keys[2 * i]),
             Controller(d_model, d_control, len(budgets), key=keys[2 * i + 1]))
            for i in range(len(blocks))
        )  # fmt: skip
        self.budgets, self.budget = tuple(float(b) for b in budgets), budgets.index(budget)
        self.budget_weight, self.noise = float(budget_weight), float(noise)

    def apply(
        self,
        x: Float[Array, "seq d_model"],
        *,
        kv_mask: Bool[Array, " seq"] | None = None,
        bias: Any = None,
        positions: Real[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        readout: Readout | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """Arguments as `Block.apply_maps`'s (`readout` unused). Returns `([seq, d_model],
        Produced)`: the blocks' own, the budget loss and the "cct_depth" tally."""
        del readout
        draw, *keys = _split(key, 1 + len(self.blocks))
        budget = jnp.asarray(self.budget)
        if draw is not None and not inference:  # this example's budget, one of the training tasks
            budget = jax.random.randint(draw, (), 0, len(self.budgets))
        produced, gates = Produced(), []
        for i, (block, (c_attn, c_ffn), k) in enumerate(zip(self.blocks, self.controllers, keys, strict=True)):
            ka, kf, kg, kh = _split(k, 4)
            g = gate(c_attn(x, budget), noise=self.noise, key=kg, inference=inference)
            y, made = block.attention_branch(
                x, kv_mask=kv_mask, bias=bias, positions=positions, key=ka, inference=inference
            )
            x = x + g[:, None].astype(x.dtype) * y
            produced = produced + made.under("blocks", i)
            gates.append(g)
            g = gate(c_ffn(x, budget), noise=self.noise, key=kh, inference=inference)
            y, made = block.ffn_branch(x, mask=kv_mask, token_ids=token_ids, key=kf, inference=inference)
            x = x + g[:, None].astype(x.dtype) * y
            produced = produced + made.under("blocks", i)
            gates.append(g)
        real = jnp.ones(x.shape[:1], jnp.float32) if kv_mask is None else kv_mask.astype(jnp.float32)
        used = jnp.stack(gates).mean(0)  # [seq]: the fraction of sub-layers each token ran
        fraction = (used * real).sum() / jnp.maximum(real.sum(), 1.0)
        target = jnp.asarray(self.budgets)[budget]
        loss = self.budget_weight * jnp.square(fraction - target)
        depth = tally((used * real).sum() * len(self.blocks), real.sum())
        return x, produced + Produced(layer_losses={"budget_loss": loss}, tallies={"cct_depth": depth})

    def init_decode_state(self, max_len: int, dtype) -> tuple:
        return tuple(b.init_decode_state(max_len, dtype) for b in self.blocks)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: tuple,
        *,
        bias_fn: Any = None,
        token_id: Int[Array, ""] | None = None,
        readout: Readout | None = None,
    ) -> tuple[Float[Array, " d_model"], tuple]:
        """One token at the inference budget, gates discrete."""
        del readout
        budget, new = jnp.asarray(self.budget), []
        ids = None if token_id is None else token_id[None]
        for block, (c_attn, c_ffn), cache in zip(self.blocks, self.controllers, state, strict=True):
            g = gate(c_attn(x[None], budget), noise=0.0, key=None, inference=True)[0]
            y, cache = block.attention.decode_step(normalise(block.norms[0], x, None), cache, bias_fn=bias_fn)
            x = x + g.astype(x.dtype) * y
            g = gate(c_ffn(x[None], budget), noise=0.0, key=None, inference=True)[0]
            x = x + g.astype(x.dtype) * block.ffn_branch(x[None], token_ids=ids, inference=True)[0][0]
            new.append(cache)
        return x, tuple(new)


# ----------------------------------------------------------------------------- early exit


def confidence_exit(probabilities: Float[Array, " layers *rows classes"], threshold: float) -> Int[Array, " *rows"]:
    """The exit layer (0-based) of each row: the first layer whose top probability is at
    least `threshold` (Elbayad et al. 2020's confidence thresholding), the last if none is."""
    confident = probabilities.max(-1) >= threshold
    confident = confident.at[-1].set(True)
    return jnp.argmax(confident, axis=0)


def patience_exit(predictions: Int[Array, " layers *rows"], patience: int) -> Int[Array, " *rows"]:
    """PABEE's exit layer (0-based) of each row (Zhou et al. 2020, eq. 6): cnt_i = cnt_{i-1} + 1
    when layer i predicts what layer i - 1 did, else 0 (cnt_0 = 0); the first i with
    cnt_i = patience, the last layer if none."""
    same = jnp.concatenate([jnp.zeros_like(predictions[:1], bool), predictions[1:] == predictions[:-1]])

    def count(c, s):
        c = jnp.where(s, c + 1, 0)
        return c, c

    counts = jax.lax.scan(count, jnp.zeros(predictions.shape[1:], jnp.int32), same)[1]
    reached = (counts >= patience).at[-1].set(True)
    return jnp.argmax(reached, axis=0)


def exit_weights(training: str, layers: int) -> Float[Array, " layers"]:
    """The exits' loss weights, summing to 1: aligned, uniform (Elbayad et al. 2020's ω_n);
    weighted, PABEE's j / sum j (layer j = 1..L, Zhou et al. 2020, eq. 5)."""
    raw = jnp.arange(1, layers + 1, dtype=jnp.float32) if training == "weighted" else jnp.ones((layers,))
    return raw / raw.sum()


class ExitStack(eqx.Module):
    """Transformer blocks with an exit after each (`readout(i, x, mask)`: the model's
    logits after block i, the last block's being its usual output).

    Training ("aligned" or "weighted"): every exit's logits with `exit_weights`
    (`Produced.exits`; the train step's cross-entropy is their weighted sum). "mixed"
    (language models; Elbayad et al. 2020): `samples` draws of an exit block per token,
    uniform over the blocks; a token's state after its exit is copied to the blocks above
    (they run on the copy, which later tokens attend), and its loss is its exit's, each draw
    weighted 1 / samples. Inference: per token of a language model (`per_token`) the state
    is copied above its exit, so the model's readout of the last state is the exit's
    prediction (and decoding runs the same way: a copied state still writes its keys and
    values); per example of a classifier, the exit's logits are the output. The exit
    block (1-based) of each real token or example is the "exit_depth" tally."""

    blocks: tuple[Block, ...]
    rule: str = eqx.field(static=True)
    threshold: float = eqx.field(static=True)
    patience: int = eqx.field(static=True)
    training: str = eqx.field(static=True)
    samples: int = eqx.field(static=True)
    per_token: bool = eqx.field(static=True)

    def __init__(
        self,
        blocks: list[Block],
        *,
        rule: str,
        training: str,
        per_token: bool,
        threshold: float = 0.9,
        patience: int = 2,
        samples: int = 1,
    ):
        if rule not in EXIT_RULES or training not in EXIT_TRAININGS:
            raise ValueError(f"rule in {EXIT_RULES}, training in {EXIT_TRAININGS}; got {rule=}, {training=}")
        if rule == "patience" and per_token:
            raise ValueError("the patience rule exits whole examples (PABEE's classifiers); got per_token=True")
        if training == "mixed" and not per_token:
            raise ValueError("mixed training draws an exit per token (a language model); got per_token=False")
        self.blocks, self.rule, self.training, self.per_token = tuple(blocks), rule, training, per_token
        self.threshold, self.patience, self.samples = float(threshold), int(patience), int(samples)

    def _layer(self, i, x, copied, *, kv_mask, bias, positions, token_ids, key, inference):
        """Block i on x, rows in `copied` (`[seq]` bool or None) keeping their state."""
        y, made = self.blocks[i].apply(
            x, kv_mask=kv_mask, bias=bias, positions=positions, token_ids=token_ids, key=key, inference=inference
        )
        if copied is not None:
            y = jnp.where(copied[:, None], x, y)
        return y, made.under("blocks", i)

    def _confident(self, logits: Array) -> Array:
        """Whether each row of one block's logits `[*rows, classes]` is confident enough to
        exit there (the confidence rule, one block at a time)."""
        return jax.nn.softmax(logits.astype(jnp.float32), -1).max(-1) >= self.threshold

    def _exit_of(self, logits: Array) -> Array:
        """The exit layer (0-based) from every layer's logits `[layers, *rows, classes]`."""
        if self.rule == "confidence":
            return confidence_exit(jax.nn.softmax(logits.astype(jnp.float32), -1), self.threshold)
        return patience_exit(jnp.argmax(logits, -1), self.patience)

    def apply(
        self,
        x: Float[Array, "seq d_model"],
        *,
        kv_mask: Bool[Array, " seq"] | None = None,
        bias: Any = None,
        positions: Real[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        readout: Readout | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """Arguments as `Block.apply_maps`'s, plus `readout` (required). Returns `([seq,
        d_model], Produced)` with `exits` and the "exit_depth" tally."""
        if readout is None:
            raise ValueError("an early-exit stack needs the model's readout (readout=...)")
        layers, n = len(self.blocks), x.shape[0]
        real = jnp.ones((n,), jnp.float32) if kv_mask is None else kv_mask.astype(jnp.float32)
        args = dict(kv_mask=kv_mask, bias=bias, positions=positions, token_ids=token_ids, inference=inference)
        keys = _split(key, layers + 1)
        produced = Produced()
        if self.training == "mixed" and not inference:
            return self._mixed(x, readout, keys, real, args)
        exited = jnp.zeros((n,), bool) if (inference and self.per_token) else None
        depth = jnp.full((n,), layers, jnp.int32)
        outputs, h = [], x
        for i in range(layers):
            h, made = self._layer(i, h, exited, key=keys[i], **args)
            produced = produced + made
            logits = readout(i, h, kv_mask)
            outputs.append(logits)
            if exited is not None:  # a language model: this block's confident tokens leave here
                leaving = ~exited & self._confident(logits) if i < layers - 1 else ~exited
                depth = jnp.where(leaving, i + 1, depth)
                exited = exited | leaving
        stacked = jnp.stack(outputs)
        if inference and not self.per_token:  # a classifier: the example leaves at its exit
            at = self._exit_of(stacked)
            exits = Exits(stacked[at][None], jnp.ones((1,)), stacked[at])
            return h, produced + Produced(exits=exits, tallies={"exit_depth": tally(at + 1, 1)})
        depth_tally = tally((depth * real).sum(), real.sum()) if self.per_token else tally(layers, 1)
        tallies = {"exit_depth": depth_tally}
        if inference:  # a language model's copied states: its readout of h is each token's exit's
            return h, produced + Produced(tallies=tallies)
        exits = Exits(stacked, exit_weights(self.training, layers), stacked[-1])
        return h, produced + Produced(exits=exits, tallies=tallies)

    def _mixed(self, x, readout, keys, real, args):
        """Elbayad et al. 2020's mixed training: `samples` forwards, each with an exit block
        drawn per token and the states copied above it."""
        layers, n = len(self.blocks), x.shape[0]
        draws = _split(keys[-1], self.samples)
        outputs, produced, depths = [], Produced(), []
        h = x
        for s, draw in enumerate(draws):
            exit_at = jnp.full((n,), layers - 1) if draw is None else jax.random.randint(draw, (n,), 0, layers)
            h, out = x, None
            for i in range(layers):
                copied = exit_at < i
                h, made = self._layer(i, h, copied, key=None if keys[i] is None else jax.random.fold_in(keys[i], s),
                                      **args)  # fmt: skip
                produced = produced + made
                logits = readout(i, h, args["kv_mask"])
                out = logits if out is None else jnp.where((exit_at == i)[:, None], logits, out)
            outputs.append(out)
            depths.append(((exit_at + 1) * real).sum())
        stacked = jnp.stack(outputs)
        exits = Exits(stacked, jnp.full((self.samples,), 1.0 / self.samples), stacked[0])
        depth = tally(sum(depths) / self.samples, real.sum())
        return h, produced + Produced(exits=exits, tallies={"exit_depth": depth})

    def init_decode_state(self, max_len: int, dtype) -> tuple:
        return tuple(b.init_decode_state(max_len, dtype) for b in self.blocks)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: tuple,
        *,
        bias_fn: Any = None,
        token_id: Int[Array, ""] | None = None,
        readout: Readout | None = None,
    ) -> tuple[Float[Array, " d_model"], tuple]:
        """One token: its state copied above its exit block (every block still runs, so a
        copied state writes its keys and values as the parallel forward's does)."""
        if readout is None:
            raise ValueError("an early-exit stack needs the model's readout (readout=...)")
        exited, new = jnp.zeros((), bool), []
        for i, (block, cache) in enumerate(zip(self.blocks, state, strict=True)):
            y, cache = block.decode_step(x, cache, bias_fn=bias_fn, token_id=token_id)
            x = jnp.where(exited, x, y)
            new.append(cache)
            if i < len(self.blocks) - 1:
                logits = readout(i, x[None], None)
                exited = exited | self._confident(logits)[0]
        return x, tuple(new)


ADAPTIVE_STACKS = (UniversalStack, GatedStack, ExitStack)


def mean_tally(value: Array) -> Array:
    """A tally's mean: sum / max(count, 1) (value `[..., 2]`, summed over any leading axes)."""
    value = value.reshape(-1, 2).sum(0)
    return value[0] / jnp.maximum(value[1], 1.0)


__all__ = [
    "ACT_STATES",
    "ADAPTIVE_STACKS",
    "EXIT_RULES",
    "EXIT_TRAININGS",
    "STEP_EMBEDDINGS",
    "Controller",
    "ExitStack",
    "GatedStack",
    "UniversalStack",
    "act_update",
    "confidence_exit",
    "exit_weights",
    "gate",
    "mean_tally",
    "patience_exit",
    "tally",
]
