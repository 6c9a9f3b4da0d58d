"""FLOATER (Liu, Yu, Dhillon & Hsieh 2020, "Learning to Encode Position for Transformer
with Continuous Dynamical Model", ICML, arXiv 2003.09229): positions from a neural ODE.

p(t) = p(0) + ∫_0^t h(τ, p(τ); θ) dτ, read at t_i = i Δ for position i. One dynamics h is
shared by every block; block n starts from its own learned p^(n)(0), so each block gets
its own trajectory p^(n)(t_i), which its self-attention adds to its input before the
query, key and value projections (`jxformers.nn.relative.RelativeTerms` kind "floater"
carries it there; the model solves all blocks at once, `Floater.grid`). h is the
authors' code's `flow_func_linear`: a two-layer network with the time appended to the
input of each layer, h(t, p) = W_2 [relu(W_1 [p; t] + b_1); t] + b_2.

The ODE is solved here by a fixed-step classical Runge-Kutta (RK4), `steps` steps per
interval Δ (the authors' torchdiffeq call: "rk4" with step Δ/5), and differentiated
through the solver's steps (the authors use the adjoint method: the same gradient up to
the solver's error, at the cost of O(n steps) stored states here).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from jxformers.nn.layers import Linear

# The authors' code's Δ (`time_dt`) and RK4 steps per Δ (step size Δ/5).
FLOATER_DELTA = 0.01
FLOATER_STEPS = 5


def rk4_step(f, t: Float[Array, ""], y: Float[Array, "*s"], dt: float) -> Float[Array, "*s"]:
    """One classical Runge-Kutta step of dy/dt = f(t, y) from (t, y) by dt."""
    k1 = f(t, y)
    k2 = f(t + dt / 2, y + dt / 2 * k1)
    k3 = f(t + dt / 2, y + dt / 2 * k2)
    k4 = f(t + dt, y + dt * k3)
    return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def rk4_interval(f, y: Float[Array, "*s"], i: Int[Array, ""], *, delta: float, steps: int) -> Float[Array, "*s"]:
    """y(t_{i+1}) from y(t_i), t_i = i Δ: `steps` RK4 steps of Δ/steps. Step k starts at
    (i steps + k) Δ/steps, computed the same way wherever it is called (a whole grid or
    one decoding step), so both give the same numbers."""
    dt = delta / steps
    for k in range(steps):
        t = (i * steps + k).astype(jnp.float32) * dt
        y = rk4_step(f, t, y, dt)
    return y


class FlowDynamics(eqx.Module):
    """h(t, p) = W_2 [relu(W_1 [p; t] + b_1); t] + b_2, `dim` -> `dim` (the authors'
    `flow_func_linear`, time appended to each layer's input). Weights Xavier-normal and
    biases zero, as their `Linear_t`."""

    first: Linear
    second: Linear

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        std = (2.0 / (2 * dim + 1)) ** 0.5  # Xavier-normal of a (dim + 1) -> dim matrix

        def layer(k):
            made = Linear(dim + 1, dim, key=k)
            return eqx.tree_at(
                lambda m: (m.weight, m.bias), made, (std * jax.random.normal(k, (dim, dim + 1)), jnp.zeros((dim,)))
            )

        self.first, self.second = layer(k1), layer(k2)

    def __call__(self, t: Float[Array, ""], p: Float[Array, "*rows dim"]) -> Float[Array, "*rows dim"]:
        def with_time(x):
            return jnp.concatenate([x, jnp.broadcast_to(t, (*x.shape[:-1], 1)).astype(x.dtype)], -1)

        return self.second(with_time(jax.nn.relu(self.first(with_time(p)))))


class Floater(eqx.Module):
    """FLOATER's dynamics and every block's start: `start` p^(n)(0) `[layers, dim]`
    (~ N(0, 0.02^2); the authors draw theirs Xavier-uniform, about the same scale at
    their sizes), `dynamics` h shared by the blocks, `delta` Δ, `steps` RK4 steps per Δ.

    `grid(n)` -> `[layers, n, dim]`, p^(n)(t_i) for i < n (one scan of n - 1 intervals,
    O(n steps layers dim^2) time, sequential in n); `advance(p, i)` -> p(t_{i+1}) from
    p(t_i) `[layers, dim]` (a decoding step: O(steps layers dim^2)).
    """

    start: Float[Array, "layers dim"]
    dynamics: FlowDynamics
    delta: float = eqx.field(static=True)
    steps: int = eqx.field(static=True)

    def __init__(
        self, *, layers: int, dim: int, delta: float = FLOATER_DELTA, steps: int = FLOATER_STEPS, key: PRNGKeyArray
    ):
        if layers < 1 or steps < 1 or not delta > 0:
            raise ValueError(f"FLOATER needs layers >= 1, steps >= 1 and Δ > 0; got {layers=}, {steps=}, {delta=}")
        ks, kd = jax.random.split(key)
        self.start = 0.02 * jax.random.normal(ks, (layers, dim))
        self.dynamics = FlowDynamics(dim, key=kd)
        self.delta, self.steps = delta, steps

    def advance(self, p: Float[Array, "layers dim"], i: Int[Array, ""]) -> Float[Array, "layers dim"]:
        """p(t_{i+1}) from p(t_i), computed in float32."""
        return rk4_interval(self.dynamics, p.astype(jnp.float32), i, delta=self.delta, steps=self.steps)

    def grid(self, n: int) -> Float[Array, "layers n dim"]:
        """p^(l)(t_i) for every block l and position i < n."""

        def step(p, i):
            nxt = self.advance(p, i)
            return nxt, nxt

        _, later = jax.lax.scan(step, self.start, jnp.arange(max(n - 1, 0)))
        return jnp.concatenate([self.start[:, None], jnp.moveaxis(later, 0, 1)], axis=1)[:, :n]
