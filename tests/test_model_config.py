"""ModelConfig as components: each architecture and task in the component form and in
the flat form of earlier versions (converted, one FlatConfigWarning naming the new keys)
builds the same model; a setting exists only on its component; configs round-trip
through YAML; a run saved in the flat form resumes."""

import warnings

import equinox as eqx
import jax
import numpy as np
import pytest
import yaml

from jxformers.nn import build_model
from jxformers.nn import moe as moe_lib
from jxformers.nn import pkm as pkm_lib
from jxformers.nn import tokenlearner as tokenlearner_lib
from jxformers.nn.config import (
    FlatConfigWarning,
    ModelConfig,
    MoEConfig,
    PKMConfig,
    TokenLearnerConfig,
    TransformerStack,
    legacy,
)

SMALL = dict(vocab_size=29, num_layers=2, d_model=16, num_heads=2, max_len=16)

# (the flat form, the component form) of each architecture and task
PAIRS = {
    "classify": (
        dict(
            task="classify",
            attention="performer",
            attention_kwargs={"num_features": 8},
            d_ff=24,
            pooling="mean",
            position="learned",
        ),
        dict(
            task="classify",
            attention={"name": "performer", "num_features": 8},
            ffn={"kind": "gelu", "d_ff": 24},
            head="mean",
            embedding={"position": "learned"},
        ),
    ),
    "retrieval": (
        dict(task="retrieval", pooling="pma", pma_seeds=2, ffn="swiglu"),
        dict(task="retrieval", head={"kind": "pma", "pma_seeds": 2}, ffn="swiglu"),
    ),
    "lm": (
        dict(
            task="lm",
            attention="local",
            attention_kwargs={"window": 3},
            impl="xla",
            position="rope",
            reversible=True,
            tie_embeddings=False,
        ),
        dict(
            task="lm",
            attention={"name": "local", "window": 3, "impl": "xla"},
            embedding={"position": "rope"},
            stack={"kind": "transformer", "reversible": True},
            head={"kind": "softmax", "tie_embeddings": False},
        ),
    ),
    "seq2seq": (
        dict(task="seq2seq", decoder_layers=1, cross_attention="linear", filters={1: 0.5}, downsample="funnel"),
        dict(
            task="seq2seq",
            decoder={"num_layers": 1, "cross_attention": "linear"},
            stack={"filters": {1: 0.5}, "downsample": "funnel"},
        ),
    ),
    "isab": (
        dict(architecture="isab", memory_size=4, pooling="mean"),
        dict(stack={"kind": "isab", "num_inducing": 4}, head="mean"),
    ),
    "luna": (
        dict(task="lm", architecture="luna", memory_size=4),
        dict(task="lm", stack={"kind": "luna", "packed_len": 4}),
    ),
    "perceiver": (
        dict(architecture="perceiver", memory_size=4, cross_attends=2, pooling="mean"),
        dict(stack={"kind": "perceiver", "num_latents": 4, "cross_attends": 2}, head="mean"),
    ),
    "transformer_xl": (
        dict(task="lm", architecture="transformer_xl", position="none", mem_len=4, eval_mem_len=8),
        dict(task="lm", stack={"kind": "transformer_xl", "mem_len": 4, "eval_mem_len": 8}),
    ),
    "compressive": (
        dict(
            task="lm",
            architecture="compressive",
            position="none",
            mem_len=4,
            cmem_len=2,
            compression="mean",
            compression_rate=2,
        ),
        dict(
            task="lm",
            stack={"kind": "compressive", "mem_len": 4, "cmem_len": 2, "compression": "mean", "compression_rate": 2},
        ),
    ),
    "moe": (
        dict(task="lm", ffn="gelu", d_ff=24, layer_overrides={1: {"ffn": "moe"}}, moe={"num_experts": 4, "top_k": 2}),
        dict(
            task="lm",
            ffn={"kind": "gelu", "d_ff": 24},
            stack={"layer_overrides": {1: {"ffn": {"kind": "moe", "d_ff": 24, "num_experts": 4, "top_k": 2}}}},
        ),
    ),
    "pkm": (dict(ffn="pkm", pkm={"num_keys": 4, "top_k": 2}), dict(ffn={"kind": "pkm", "num_keys": 4, "top_k": 2})),
    "token_learner": (
        dict(num_layers=3, token_learner={"after_layer": 0, "num_tokens": 4}),
        dict(num_layers=3, stack={"token_learner": {"after_layer": 0, "num_tokens": 4}}),
    ),
    "mixture": (
        dict(task="lm", vocab_size=257, output_head="mixture_of_logistics", mixture_components=3),
        dict(task="lm", vocab_size=257, head={"kind": "mixture_of_logistics", "components": 3}),
    ),
    "bert": (
        dict(
            position="learned",
            norm_placement="post",
            embed_scale=False,
            embed_norm=True,
            type_vocab_size=2,
            norm_eps=1e-12,
            final_norm=False,
            pooling="mean",
        ),
        dict(
            embedding={"position": "learned", "scale": False, "norm": True, "type_vocab_size": 2},
            norm={"placement": "post", "eps": 1e-12, "final": False},
            head="mean",
        ),
    ),
}


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_both_forms_give_the_same_config_and_model(name):
    flat, components = PAIRS[name]
    with pytest.warns(FlatConfigWarning) as caught:
        old = ModelConfig(**(SMALL | flat))
    assert len([w for w in caught if w.category is FlatConfigWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatConfigWarning)
        new = ModelConfig(**(SMALL | components))
    assert old == new
    a, b = (build_model(c, key=jax.random.key(0)) for c in (old, new))
    assert jax.tree.structure(eqx.filter(a, eqx.is_array)) == jax.tree.structure(eqx.filter(b, eqx.is_array))
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # YAML and back, as config.yaml keeps it
    assert ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(new.to_dict()))) == new


def test_the_warning_names_each_flat_key_and_its_new_place():
    with pytest.warns(FlatConfigWarning) as caught:
        ModelConfig(task="lm", attention_kwargs={"chunk_size": 4}, attention="linear", d_ff=32, mem_len=0)
    assert str(caught[0].message) == (
        "flat model config keys are deprecated and were converted: attention_kwargs -> attention.<hyper-parameter>,"
        " d_ff -> ffn.d_ff, mem_len -> stack.mem_len"
    )


@pytest.mark.parametrize(
    "values, match",
    [
        (dict(stack={"kind": "transformer", "mem_len": 4}), r"stack 'transformer': unknown setting\(s\) \['mem_len'\]"),
        (dict(stack={"kind": "isab", "filters": {0: 0.5}}), r"stack 'isab': unknown setting\(s\) \['filters'\]"),
        (dict(ffn={"kind": "gelu", "num_experts": 4}), r"ffn 'gelu': unknown setting\(s\) \['num_experts'\]"),
        (dict(ffn="pkm"), r"ffn 'pkm' needs \['num_keys'\]"),
        (dict(decoder={"num_layers": 2}), "decoder configures the decoder of task seq2seq"),
        (dict(head="softmax"), "head 'softmax' serves tasks lm, seq2seq; got task 'classify'"),
        (dict(task="lm", head="cls"), "head 'cls' serves tasks classify, retrieval"),
        (dict(stack="luna", attention="performer"), "builds its own softmax attentions"),
        (dict(stack="isab", ffn={"kind": "moe"}), "takes a dense ffn"),
        (dict(attention={"name": "local", "impl": "fast"}), "attention.impl must be one of"),
        (dict(attention={"name": "nystrom", "impl": "pallas"}), "nystrom attention has no Pallas kernel"),
        (dict(norm={"kind": "batchnorm"}), "norm kind must be one of"),
        (dict(norm={"placement": "middle"}), "norm.placement must be one of"),
        (dict(embedding={"position": "rotary"}), "embedding.position must be one of"),
        (dict(embedding={"colour": 1}), r"embedding: unknown setting\(s\) \['colour'\]"),
        (dict(stack={"layer_overrides": {9: {"ffn": "relu"}}}), "block 9 does not exist"),
        (dict(stack={"layer_overrides": {0: {"heads": 2}}}), "may set attention and ffn"),
        (dict(stack={"kind": "compressive", "mem_len": 4, "compression_rate": 3}), "multiples of it"),
        (dict(flavour=1), r"unknown model config key\(s\) \['flavour'\]; known: \['attention'"),
    ],
)
def test_a_setting_exists_only_on_its_component(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(SMALL | values))


def test_component_dataclasses_are_accepted_and_defaults_are_written_once():
    config = ModelConfig(task="lm", stack=TransformerStack(), ffn=MoEConfig(num_experts=2))
    assert isinstance(config.stack, TransformerStack) and config.ffn.num_experts == 2
    with pytest.raises(ValueError, match="no reversible wiring"):
        ModelConfig(task="lm", stack=TransformerStack(reversible=True), ffn=MoEConfig(num_experts=2))
    # The modules' keyword defaults are their config dataclasses' defaults.
    assert {k: v for k, v in MoEConfig().settings().items()} == moe_lib.SETTINGS
    assert {k: v for k, v in PKMConfig(num_keys=8).settings().items() if k != "num_keys"} == pkm_lib.SETTINGS
    assert {k: v for k, v in tokenlearner_lib.SETTINGS.items() if v is not None} == {
        "fuse": TokenLearnerConfig.fuse,
        "maps": TokenLearnerConfig.maps,
        "bottleneck": TokenLearnerConfig.bottleneck,
    }


def test_every_field_has_a_doc():
    import dataclasses

    from jxformers.nn.config import components

    classes = [
        ModelConfig,
        MoEConfig,
        PKMConfig,
        TokenLearnerConfig,
        *{
            c
            for table in (components.FFN_COMPONENTS, components.STACK_COMPONENTS, components.HEAD_COMPONENTS)
            for c in table.values()
        },
        components.AttentionConfig,
        components.EmbeddingConfig,
        components.NormConfig,
        components.DecoderConfig,
        components.LayerConfig,
    ]
    undocumented = [
        f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if not f.metadata.get("doc")
    ]
    assert not undocumented


def test_a_run_saved_in_the_flat_form_resumes_without_differences(tmp_path):
    from jxformers.train import workdir

    flat = SMALL | dict(
        task="lm",
        attention="local",
        attention_kwargs={"window": 3},
        d_ff=24,
        position="rope",
        norm_placement="pre",
        tie_embeddings=True,
        mem_len=0,
        cmem_len=0,
        compression="conv",
        compression_rate=3,
        filters={},
        layer_overrides={},
        moe={},
        pkm={},
        token_learner={},
        architecture="transformer",
        memory_size=16,
        cross_attends=1,
        pma_seeds=1,
        impl="auto",
        pooling="cls",
        output_head="softmax",
        mixture_components=10,
        decoder_layers=None,
        embed_scale=True,
        embed_norm=False,
        type_vocab_size=0,
        norm_eps=None,
        final_norm=True,
        reversible=False,
        downsample="fourier",
        ffn_chunk_size=None,
        eval_mem_len=None,
        cross_attention="softmax",
        cross_attention_kwargs={},
    )  # every key an old config.yaml held
    (tmp_path / workdir.CONFIG).write_text(yaml.safe_dump({"name": "old", "model": flat}))
    saved = workdir.saved_config(tmp_path)
    new = ModelConfig(
        **(
            SMALL
            | dict(
                task="lm",
                attention={"name": "local", "window": 3},
                ffn={"kind": "gelu", "d_ff": 24},
                embedding={"position": "rope"},
            )
        )
    )
    assert workdir.differences(saved, {"name": "old", "model": new.to_dict()}) == {}
    assert legacy.flat_keys(saved["model"]) == []


def test_replace_with_a_flat_key_reaches_the_component():
    import dataclasses

    config = ModelConfig(**(SMALL | dict(task="lm", ffn={"kind": "swiglu", "d_ff": 24, "chunk_size": 5})))
    with pytest.warns(FlatConfigWarning, match="ffn_chunk_size -> ffn.chunk_size"):
        plain = dataclasses.replace(config, ffn_chunk_size=None)
    assert plain.ffn == dataclasses.replace(config.ffn, chunk_size=None)
