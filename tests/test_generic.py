"""The generic suites (tests/suites.py) for every attention the package ships. One
registered elsewhere (tests/test_toy_attention.py) instantiates them for itself."""

from suites import AttentionSuite, ModelSuite, jit_variants

from jxformers import registry

SHIPPED = tuple(n for n in registry.names() if registry.get(n).op.__module__.startswith("jxformers."))


class TestAttentions(AttentionSuite):
    attention_names = SHIPPED


class TestModels(ModelSuite):
    attention_names = SHIPPED


TestJitVmapGrad = jit_variants(SHIPPED)
