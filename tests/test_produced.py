"""What a forward makes besides its output comes back as a value (`jxformers.nn.Produced`):
its sum and paths, the k-means inputs of a module called twice grouped by its path, and
the train step's metrics read from it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jxformers import nn
from jxformers.nn import AttentionInputs, ModelConfig, Produced, build_model


def test_produced_adds_in_call_order_and_prefixes_paths():
    q = jnp.ones((3, 2, 4))
    a = Produced(moe=({"loss": jnp.ones(())},), attention_inputs=(AttentionInputs(q, q, None, ("attention",)),))
    b = Produced(moe=({"loss": 2 * jnp.ones(())},), losses={"r": jnp.ones(())}, memory={"m": jnp.zeros(2)})
    c = Produced(losses={"r": 2 * jnp.ones(())})
    total = a.under("blocks", 0) + b + c
    assert [float(m["loss"]) for m in total.moe] == [1.0, 2.0]
    assert [x.path for x in total.attention_inputs] == [("blocks", 0, "attention")]
    assert float(total.losses["r"]) == 3.0  # a loss made twice is summed
    assert total.memory is b.memory  # the later memory is kept
    assert nn.produced.total([a, b]).moe == (a + b).moe


def test_layer_losses_are_named_by_their_layer_and_summed_only_at_one_layer():
    """A module makes its loss under the loss name; each caller's `under` adds where it
    sits, so two layers' losses stay apart and one layer called twice sums its own."""
    from jxformers.nn.produced import layer_path, loss_name

    made = Produced(layer_losses={"span_loss": jnp.ones(())})
    block = made.under("attention")
    assert set(block.layer_losses) == {"span_loss/attention"}
    two = block.under("blocks", 0) + block.under("blocks", 1) + block.under("blocks", 1)
    assert {k: float(v) for k, v in two.layer_losses.items()} == {
        "span_loss/blocks.0.attention": 1.0,
        "span_loss/blocks.1.attention": 2.0,
    }
    assert loss_name("span_loss/blocks.0.attention") == "span_loss"
    assert layer_path("span_loss/blocks.0.attention") == "blocks.0.attention"
    assert layer_path("span_loss") == ""


def test_a_module_called_twice_is_updated_once_from_both_calls():
    """A dual-tower model runs one encoder on both inputs: each routing module returns
    two sets of inputs with the same path, and its centroids move once, from both."""
    config = ModelConfig(
        task="retrieval",
        vocab_size=11,
        num_classes=2,
        num_layers=1,
        d_model=16,
        num_heads=2,
        max_len=12,
        attention={"name": "routing", "n_clusters": 2, "local_heads": 0},
        ffn={"kind": "gelu", "d_ff": 16},
        head="mean",
    )
    model = build_model(config, key=jax.random.key(0))
    t1 = jax.random.randint(jax.random.key(1), (2, 12), 0, 11)
    t2 = jax.random.randint(jax.random.key(2), (2, 12), 0, 11)
    produced = eqx.filter_jit(lambda m, a, b: jax.vmap(lambda x, y: m.apply(x, y)[1])(a, b))(model, t1, t2)
    path = ("tower", "encoder", "blocks", 0, "attention")
    assert [x.path for x in produced.attention_inputs] == [path, path]
    moved = nn.update_arrays(model, produced.attention_inputs)
    module = nn.produced.follow(model, path)
    first, second = produced.attention_inputs
    masks = jnp.ones((4, 12), bool)
    q, k = jnp.concatenate([first.q, second.q]), jnp.concatenate([first.k, second.k])
    expected = module.core.update_arrays(module.drawn, q, k, kv_mask=masks)["centroids"]
    got = nn.produced.follow(moved, path).drawn["centroids"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(module.drawn["centroids"]))
    # from one call only, the update differs: both calls count
    alone = nn.update_arrays(model, produced.attention_inputs[:1])
    assert not np.allclose(np.asarray(nn.produced.follow(alone, path).drawn["centroids"]), np.asarray(got))


def test_inputs_naming_something_else_than_an_attention_are_refused():
    model = build_model(
        ModelConfig(task="classify", vocab_size=11, num_classes=2, num_layers=1, d_model=16, num_heads=2, max_len=8),
        key=jax.random.key(0),
    )
    q = jnp.ones((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"\('encoder', 'blocks', 0, 'ffn'\).*not an Attention"):
        nn.update_arrays(model, [AttentionInputs(q, q, None, ("encoder", "blocks", 0, "ffn"))])


def test_the_train_step_logs_what_the_model_produced():
    """One step for every model: an MoE LM's metrics carry its layers' aux entries, read
    from `Produced.moe` (none for a dense model)."""
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    def one_step(ffn):
        config = ModelConfig(
            task="lm", vocab_size=11, num_layers=2, d_model=16, num_heads=2, max_len=8, ffn=ffn, dropout=0.0
        )
        params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))
        optimizer = optax.adam(1e-3)
        state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
        tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, 11)
        batch = {"tokens": tokens, "mask": jnp.ones((4, 8), bool), "loss_mask": jnp.ones((4, 8), bool)}
        return make_train_step(static, optimizer, grad_accum=2)(state, batch)[1]

    moe = one_step({"kind": "moe", "num_experts": 2, "d_ff": 16})
    assert {f"moe{j}/balance_loss" for j in range(2)} <= set(moe)
    assert moe["moe0/expert_load"].shape == (2,)
    dense = one_step({"kind": "gelu", "d_ff": 16})
    assert not [name for name in dense if name.startswith("moe")]
