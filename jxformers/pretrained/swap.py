"""`swap_attention`: a model's weights under another registered attention (or with the
Fourier Transformer's spectral filters), the efficient-attention half of the point of
He et al. 2023 ("Fourier Transformer: Fast Long Range Modeling by Removing Sequence
Redundancy with FFT Operator", arXiv 2305.15099) that a pretrained model can inherit its weights and run faster."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from jxformers import registry
from jxformers.nn.config import AttentionConfig, ModelConfig, TransformerStack, build_model


def _arrays(model) -> dict[str, jax.Array]:
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _check_fits(name: str) -> None:
    spec = registry.get(name)
    if not spec.content_based or spec.shared_qk:
        fit = [
            n
            for n in registry.names(supports_kv_mask=True)
            if registry.get(n).content_based and not registry.get(n).shared_qk
        ]
        why = "takes its keys from the queries" if spec.shared_qk else "does not compare queries with keys"
        raise ValueError(
            f"{name} attention {why}, so the pretrained query/key projections would go unused; "
            f"attentions that keep every pretrained weight: {fit}"
        )


def swap_attention(
    model,
    config: ModelConfig,
    attention: str | None = None,
    attention_kwargs: Mapping[str, Any] | None = None,
    *,
    filters: Mapping[int, float] | None = None,
    downsample: str | None = None,
    key: jax.Array | None = None,
):
    """`model` (built from `config`, e.g. by `load_bert`) with every block's self-attention
    core replaced by `attention` (its hyper-parameters `attention_kwargs`) and/or the
    encoder's `filters` / `downsample` set (the new config's `attention` component,
    `stack.filters`, `stack.downsample`), keeping every learned array: the projections
    q, k, v, o, the FFNs, norms, embeddings and head are copied; arrays the new attention
    brings (Linformer's projections, Performer's features) are fresh from `key`.

    Arguments:
        model, config: the model and the ModelConfig it was built from.
        attention, attention_kwargs: a registry name and its hyper-parameters (None:
            keep the config's; its kwargs then stay unless given).
        filters, downsample: the Fourier Transformer's placement, e.g. {2: 0.5}:
            "the first 2 layers at full length, the rest at half" (He et al. 2023's Fourier-BART).
        key: PRNG key for the new attention's own arrays (default key 0).

    Returns:
        `(new_model, new_config)`.

    Raises:
        ValueError: the config refuses the new attention (e.g. a causal-only one, or a
            bias position scheme), the attention would leave pretrained weights unused
            (FNet, Synthesizer, LSH's shared query-key), or an array's shape would change.
    """
    changes: dict[str, Any] = {}
    if attention is not None:
        _check_fits(attention)
        changes["attention"] = AttentionConfig(attention, dict(attention_kwargs or {}), config.attention.impl)
    elif attention_kwargs is not None:
        changes["attention"] = dataclasses.replace(config.attention, hyper_parameters=dict(attention_kwargs))
    stack = {}
    if filters is not None:
        stack["filters"] = dict(filters)
    if downsample is not None:
        stack["downsample"] = downsample
    if stack:
        if not isinstance(config.stack, TransformerStack):
            raise ValueError(
                f"filters and downsample act between transformer blocks; the stack is {config.stack.kind!r}"
            )
        changes["stack"] = dataclasses.replace(config.stack, **stack)
    new_config = dataclasses.replace(config, **changes)
    fresh = build_model(new_config, key=jax.random.key(0) if key is None else key)
    old, new = _arrays(model), _arrays(fresh)
    attention_arrays = (".arrays[", ".drawn[", ".token_params[")  # an attention core's own: replaced, not carried
    dropped = [p for p in old if p not in new and not any(a in p for a in attention_arrays)]
    changed = {p: (old[p].shape, new[p].shape) for p in new if p in old and old[p].shape != new[p].shape}
    if dropped or changed:
        raise ValueError(
            f"swapping to {new_config.attention.name!r} would drop pretrained arrays {dropped[:4]} or "
            f"change their shapes {dict(list(changed.items())[:4])}"
        )
    leaves, treedef = jax.tree_util.tree_flatten_with_path(fresh)
    carried = [old.get(jax.tree_util.keystr(p), leaf) if eqx.is_array(leaf) else leaf for p, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, carried), new_config
