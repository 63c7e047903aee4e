"""The HF tensor shapes many families' checkpoints share: a decoder's embeddings and norms, a GQA attention
block, a gated MLP, a DeepSeek-style MTP layer. Each family's `hf_tensor_shapes` builds on these."""

from __future__ import annotations


def decoder_shapes(vocab: int, hidden: int, n_layers: int, *, tie_word_embeddings: bool) -> tuple[dict, list[str]]:
    """The tensors every HF decoder here holds (embeddings, final norm, `lm_head` unless tied, and each
    layer's input and post-attention norms), and each layer's name prefix `model.layers.{i}.`."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    prefixes = [f"model.layers.{layer}." for layer in range(n_layers)]
    for p in prefixes:
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    return shapes, prefixes


def mtp_shapes(shapes: dict, prefix: str, vocab: int, hidden: int) -> None:
    """What a DeepSeek-style MTP layer holds beyond a decoder layer (DeepSeek-V3, GLM-4.5)."""
    shapes.update({prefix + "enorm.weight": (hidden,), prefix + "hnorm.weight": (hidden,),
                   prefix + "eh_proj.weight": (hidden, 2 * hidden), prefix + "embed_tokens.weight": (vocab, hidden),
                   prefix + "shared_head.norm.weight": (hidden,), prefix + "shared_head.head.weight": (vocab, hidden)})


def attention_shapes(shapes: dict, prefix: str, hidden: int, q_out: int, kv_out: int, *,
                     qkv_bias: bool, o_bias: bool) -> None:
    """HF q/k/v/o projection shapes (and biases) of a standard multi-head / GQA attention block."""
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        shapes[f"{prefix}self_attn.{proj}.weight"] = (out, hidden)
        if qkv_bias:
            shapes[f"{prefix}self_attn.{proj}.bias"] = (out,)
    shapes[f"{prefix}self_attn.o_proj.weight"] = (hidden, q_out)
    if o_bias:
        shapes[f"{prefix}self_attn.o_proj.bias"] = (hidden,)


MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")


def mlp_shapes(shapes: dict, prefix: str, hidden: int, inter: int, leaves: tuple[str, str, str] = MLP_LEAVES, *,
               bias: bool = False) -> None:
    """A gated MLP's gate/up/down projection shapes under `prefix` (leaf names `leaves`), and biases after them."""
    gate, up, down = leaves
    shapes.update({f"{prefix}{gate}.weight": (inter, hidden), f"{prefix}{up}.weight": (inter, hidden),
                   f"{prefix}{down}.weight": (hidden, inter)})
    if bias:
        shapes.update({f"{prefix}{gate}.bias": (inter,), f"{prefix}{up}.bias": (inter,), f"{prefix}{down}.bias": (hidden,)})
