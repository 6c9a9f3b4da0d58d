"""Converters from published checkpoints to jxformers models.

bert.py       load_bert (a BERT in safetensors + config.json form -> Classifier and
              ModelConfig), bert_config, save_converted / load_converted,
              save_converted_run (a work directory of an experiment at step 0)
tokenizer.py  load_tokenizer, encode (the checkpoint's tokenizer.json, `tokenizers`)
swap.py       swap_attention: the same weights under another registered attention
              (or with the Fourier Transformer's filters)

>>> model, config = load_bert("data/minilm/model", num_classes=3)
>>> tokenizer = load_tokenizer("data/minilm/model")
>>> ids, mask = encode(tokenizer, ["To be, or not to be"], max_len=64)
>>> hidden, _ = model.encoder(ids[0], mask[0])  # BertModel's last_hidden_state
>>> fast, fast_config = swap_attention(model, config, "performer", {"num_features": 64})
"""

from jxformers.pretrained.bert import bert_config, load_bert, load_converted, save_converted, save_converted_run
from jxformers.pretrained.swap import swap_attention
from jxformers.pretrained.tokenizer import encode, load_tokenizer

__all__ = [
    "bert_config",
    "encode",
    "load_bert",
    "load_converted",
    "load_tokenizer",
    "save_converted",
    "save_converted_run",
    "swap_attention",
]
