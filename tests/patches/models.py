"""Tiny real HF and timm models built from configs (random weights), for the family tests.

Each factory takes ``dropout`` (probability for every dropout in the model) and returns ``(model, inputs)``
where ``inputs`` is a dict for ``model(**inputs)`` with labels, so ``.loss`` exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _text_inputs(vocab: int, batch=2, seq=12, labels=None, pad_last=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_last:
        mask[-1, seq - 3 :] = 0  # a padded row: padding masks reach attention
    out = {"input_ids": ids, "attention_mask": mask}
    if labels == "cls":
        out["labels"] = torch.tensor([0, 1][:batch])
    elif labels == "lm":
        out["labels"] = ids.clone()
    elif labels == "tok":
        out["labels"] = torch.randint(0, 2, (batch, seq), generator=g)
    return out


def _image_inputs(size=32, batch=2, channels=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, channels, size, size, generator=g)


def bert(dropout=0.0, head="SequenceClassification", model_type="bert"):
    import transformers as tf

    cfg_cls = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "xlm-roberta": tf.XLMRobertaConfig}[model_type]
    cfg = cfg_cls(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, max_position_embeddings=64,
                  num_labels=2, pad_token_id=1)
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[model_type]
    model = getattr(tf, f"{prefix}For{head}")(cfg)
    labels = {"SequenceClassification": "cls", "MaskedLM": "lm", "TokenClassification": "tok",
              "QuestionAnswering": None}[head]
    inputs = _text_inputs(99, labels=labels)
    if head == "QuestionAnswering":
        inputs |= {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}
    return model, inputs


def distilbert(dropout=0.0):
    import transformers as tf

    cfg = tf.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=dropout,
                              attention_dropout=dropout, max_position_embeddings=64, seq_classif_dropout=dropout)
    return tf.DistilBertForSequenceClassification(cfg), _text_inputs(99, labels="cls")


def albert(dropout=0.0):
    import transformers as tf

    cfg = tf.AlbertConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=dropout,
                          attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout,
                          max_position_embeddings=64)
    return tf.AlbertForSequenceClassification(cfg), _text_inputs(99, labels="cls")


def gpt2(dropout=0.0):
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout)
    return tf.GPT2LMHeadModel(cfg), _text_inputs(99, labels="lm", pad_last=False)


def llama(dropout=0.0, model_type="llama"):
    import transformers as tf

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    cfg = getattr(tf, f"{prefix}Config")(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attention_dropout=dropout, pad_token_id=0)
    return getattr(tf, f"{prefix}ForCausalLM")(cfg), _text_inputs(99, labels="lm", pad_last=False)


def decoder(dropout=0.0, model_type="qwen3"):
    """Decoders the LLaMA patch also covers: Qwen3 (q/k RMSNorms), Gemma and Gemma 3 (``1 + weight`` RMSNorms)."""
    import transformers as tf

    config_cls, model_cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                             "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
                             "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[model_type]
    cfg = config_cls(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=dropout,
                     pad_token_id=0)
    return model_cls(cfg), _text_inputs(99, labels="lm", pad_last=False)


def fallback_decoder(model_type="phi3"):
    """HF causal LMs without an act_hf family (the generic fallback patches them): Phi-3, Mixtral (MoE), and ones
    that scale their head's output before the loss: Granite (divided), Cohere (multiplied), Gemma 2 (soft cap); and
    Apertus, whose xIELU activation compares its input with a constant."""
    import transformers as tf

    config_cls, model_cls, extra = {
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {"logits_scaling": 8.0}),
        "cohere": (tf.CohereConfig, tf.CohereForCausalLM, {"logit_scale": 0.0625}),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 8, "final_logit_softcapping": 3.0}),
        "apertus": (tf.ApertusConfig, tf.ApertusForCausalLM, {}),  # xIELU: min(x, -1e-6) in every MLP
    }[model_type]
    cfg = config_cls(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, **extra)
    return model_cls(cfg), _text_inputs(99, labels="lm", pad_last=False)


def opt(dropout=0.1):
    """OPT (generic fallback), which calls dropout as a function after attention and after its MLP."""
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=99, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, dropout=dropout, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    return tf.OPTForCausalLM(cfg), _text_inputs(99, batch=4, seq=40, labels="lm", pad_last=False)


def seq2seq_lm(model_type="bart"):
    """Encoder-decoder LMs on the generic fallback that compute their own loss, ``CrossEntropyLoss`` on
    ``lm_logits.view(-1, V)``: BART (after adding its ``final_logits_bias``, random here) and M2M100 (no bias)."""
    import transformers as tf

    config_cls, model_cls = {"bart": (tf.BartConfig, tf.BartForConditionalGeneration),
                             "m2m100": (tf.M2M100Config, tf.M2M100ForConditionalGeneration)}[model_type]
    cfg = config_cls(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                     decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    model = model_cls(cfg)
    if hasattr(model, "final_logits_bias"):
        model.final_logits_bias.normal_(generator=torch.Generator().manual_seed(2))
    return model, _text_inputs(99, labels="lm", pad_last=False)


def t5(dropout=0.0, feed_forward_proj="relu"):
    import transformers as tf

    cfg = tf.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=dropout,
                      decoder_start_token_id=0, pad_token_id=0, feed_forward_proj=feed_forward_proj)
    inputs = _text_inputs(99, labels="lm")
    return tf.T5ForConditionalGeneration(cfg), inputs


def vit_hf(dropout=0.0):
    import transformers as tf

    cfg = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                       num_labels=3)
    return tf.ViTForImageClassification(cfg), {"pixel_values": _image_inputs(), "labels": torch.tensor([0, 2])}


def swin_hf(dropout=0.0):
    import transformers as tf

    cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, drop_path_rate=0.0,
                        num_labels=3)
    return tf.SwinForImageClassification(cfg), {"pixel_values": _image_inputs(), "labels": torch.tensor([0, 2])}


def swinv2_hf(dropout=0.0):
    """Two blocks in the first stage: the second shifts its windows, so the shift mask is used."""
    import transformers as tf

    cfg = tf.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4,
                          hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, drop_path_rate=0.0,
                          num_labels=3)
    return tf.Swinv2ForImageClassification(cfg), {"pixel_values": _image_inputs(), "labels": torch.tensor([0, 2])}


def convnext_hf(dropout=0.0):
    import transformers as tf

    cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=4, num_labels=3,
                            drop_path_rate=0.0, image_size=32)
    return tf.ConvNextForImageClassification(cfg), {"pixel_values": _image_inputs(), "labels": torch.tensor([0, 2])}


def convnextv2_hf(dropout=0.0):
    import transformers as tf

    cfg = tf.ConvNextV2Config(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=4,
                              num_labels=3, drop_path_rate=0.0, image_size=32)
    model = _random_grn(tf.ConvNextV2ForImageClassification(cfg))
    return model, {"pixel_values": _image_inputs(), "labels": torch.tensor([0, 2])}


def _random_grn(model):
    """Give every Global Response Norm random parameters: they start at zero, where GRN is the identity and
    its input gradient has no norm term to check."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("GRN", "GlobalResponseNorm")):
                m.weight.normal_(0, 0.5)
                m.bias.normal_(0, 0.5)
    return model


def _open_post_norms(model):
    """Give every LayerNorm with a zero weight (timm's Swin V2 zero-initializes its residual post-norms) a random
    one: at zero, each block's branch is cut off and none of its parameters gets a gradient to check."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None and not m.weight.any():
                m.weight.normal_(1.0, 0.2)
    return model


def timm_swinv2(name: str, **kwargs):
    """A small timm Swin V2 (two blocks in the first stage: the second shifts its windows) with open post-norms;
    every dropout at ``dropout`` (V2-CR's position-bias MLP has a fixed 0.125)."""
    def factory(dropout=0.0):
        model, inputs = timm_model(name, img_size=32, window_size=4, embed_dim=16, depths=(2, 1), num_heads=(1, 2),
                                   drop_path_rate=0.0, **kwargs)(dropout)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
        return _open_post_norms(model), inputs

    return factory


def timm_gated_vit(mlp_layer: str):
    """A tiny timm ViT whose MLPs are timm's gated ``SwiGLU`` or ``GluMlp`` (EVA-02-style)."""
    def factory(dropout=0.0):
        from timm import layers

        return timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                          mlp_layer=getattr(layers, mlp_layer))(dropout)

    return factory


def timm_convnextv2(dropout=0.0):
    model, inputs = timm_model("convnextv2_atto")(dropout)
    return _random_grn(model), inputs


def timm_model(name: str, batch: int = 2, size: int = 32, **kwargs):
    """A timm model and an image batch. Deep BatchNorm nets need ``size``/``batch`` large enough that the last
    BatchNorms see more than a couple of values per channel (random-init EfficientNet at 32x32, batch 2, has a
    gradient norm of 1e7)."""
    import timm

    def factory(dropout=0.0):
        model = timm.create_model(name, pretrained=False, num_classes=3, drop_rate=dropout, **kwargs)
        return model, {"x": _image_inputs(kwargs.get("img_size", size), batch=batch)}

    return factory


@dataclass
class Case:
    name: str
    factory: Callable
    family: str
    timm: bool = False
    max_ratio_floor: float = 1.0  # minimum saved-activation ratio at bits=3, bf16 autocast (the tests' floor)


HF_CASES = [
    Case("bert-seqcls", bert, "bert"),
    Case("bert-mlm", lambda dropout=0.0: bert(dropout, "MaskedLM"), "bert"),
    Case("bert-tokcls", lambda dropout=0.0: bert(dropout, "TokenClassification"), "bert"),
    Case("bert-qa", lambda dropout=0.0: bert(dropout, "QuestionAnswering"), "bert"),
    Case("roberta", lambda dropout=0.0: bert(dropout, model_type="roberta"), "roberta"),
    Case("xlm-roberta", lambda dropout=0.0: bert(dropout, model_type="xlm-roberta"), "xlm-roberta"),
    Case("distilbert", distilbert, "distilbert"),
    Case("albert", albert, "albert"),
    Case("gpt2", gpt2, "gpt2"),
    Case("llama", llama, "llama"),
    Case("mistral", lambda dropout=0.0: llama(dropout, "mistral"), "mistral"),
    Case("qwen2", lambda dropout=0.0: llama(dropout, "qwen2"), "qwen2"),
    Case("qwen3", decoder, "qwen3"),
    Case("gemma", lambda dropout=0.0: decoder(dropout, "gemma"), "gemma"),
    Case("gemma3", lambda dropout=0.0: decoder(dropout, "gemma3_text"), "gemma3_text"),
    Case("t5", t5, "t5"),
    Case("flan-t5", lambda dropout=0.0: t5(dropout, "gated-gelu"), "t5"),
    Case("vit-hf", vit_hf, "vit"),
    Case("swin-hf", swin_hf, "swin"),
    Case("swinv2-hf", swinv2_hf, "swinv2"),
    Case("convnext-hf", convnext_hf, "convnext"),
    Case("convnextv2-hf", convnextv2_hf, "convnextv2"),
]

TIMM_CASES = [
    Case("timm-resnet", timm_model("resnet18"), "timm:ResNet", timm=True),
    Case("timm-vit", timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), "timm:VisionTransformer",
         timm=True),
    Case("timm-vit-swiglu", timm_gated_vit("SwiGLU"), "timm:VisionTransformer", timm=True),
    Case("timm-vit-glu", timm_gated_vit("GluMlp"), "timm:VisionTransformer", timm=True),
    Case("timm-deit", timm_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
         "timm:VisionTransformer", timm=True),
    Case("timm-swin", timm_model("swin_tiny_patch4_window7_224", img_size=56, window_size=7, embed_dim=24,
                                 depths=(1, 1), num_heads=(1, 2)), "timm:SwinTransformer", timm=True),
    Case("timm-swinv2", timm_swinv2("swinv2_tiny_window8_256"), "timm:SwinTransformerV2", timm=True),
    Case("timm-swinv2-cr", timm_swinv2("swinv2_cr_tiny_224"), "timm:SwinTransformerV2Cr", timm=True),
    Case("timm-convnext", timm_model("convnext_atto"), "timm:ConvNeXt", timm=True),
    Case("timm-convnextv2", timm_convnextv2, "timm:ConvNeXt", timm=True),
    Case("timm-efficientnet", timm_model("efficientnet_b0", batch=4, size=64), "timm:EfficientNet", timm=True),
    Case("timm-efficientvit", timm_model("efficientvit_b0", batch=4, size=64, depths=(1, 1, 1, 1, 1), head_widths=(64, 80)),
         "timm:EfficientVit", timm=True),
    Case("timm-efficientvit-large", timm_model("efficientvit_l1", batch=4, size=64, widths=(8, 16, 32, 64, 128),
                                               depths=(1, 1, 1, 1, 1), head_widths=(64, 80)),
         "timm:EfficientVitLarge", timm=True),
]

ALL_CASES = HF_CASES + TIMM_CASES


def loss_of(case: Case, model, inputs) -> torch.Tensor:
    """A scalar training loss for either kind of model."""
    if case.timm:
        logits = model(inputs["x"])
        return torch.nn.functional.cross_entropy(logits.float(), torch.arange(logits.shape[0]) % logits.shape[-1])
    return model(**inputs).loss


def output_of(case: Case, model, inputs) -> torch.Tensor:
    if case.timm:
        return model(inputs["x"])
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.start_logits
