"""BERT-style encoders: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, ALBERT.

Linear, LayerNorm (its output is shared with the next Linear), GELU (few-bit), dropout (1-bit masks) and
attention (act_hf's SDPA function) are compressed; the classifier/QA/MLM head and pooler stay exact.
ALBERT shares one layer's weights across depth: each call is a separate forward with its own context, which
the slot-per-module naming handles as repeated uses of the same slot.
"""

from act_hf.patcher import register_patch

from ._hf import patch_hf


@register_patch("bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "albert")
def patch_bert(model, config) -> list[str]:
    return patch_hf(model, config)
