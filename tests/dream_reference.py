"""A plain float64 reference of the Dream family's forward, written from its description.

Dream is a bidirectional Qwen2 stack. Per layer, on the residual stream x:
  h = RMSNorm(x) * input_layernorm
  q = h Wq + bq, k = h Wk + bk, v = h Wv + bv  (GQA: query head i reads K/V head i // group)
  rotary (rotate_half, all channels, theta = rope_theta) on q and k at each token's position
  x = x + o_proj(softmax(q.k / sqrt(D) over the unpadded keys) . v)  (no o_proj bias)
  x = x + down(silu(gate(h2)) * up(h2)), h2 = RMSNorm(x) * post_attention_layernorm
then logits = lm_head(RMSNorm(x) * norm) (lm_head = embed_tokens when tied). The raw logits at
position j predict token j + 1; `shift` turns them into per-position logits: position j takes
the raw logits of j - 1, position 0 its own.

Built on the float64 pieces of reference_impl.py (loops over rows, heads, tokens and channel
pairs); nothing of dlmrt's model code is used.
"""

from __future__ import annotations

import torch

from reference_impl import F64, attention_layer, linear, prepare_inputs, rms_norm, swiglu


def dream_forward(state: dict, config: dict, ids, positions=None, key_mask=None, past=None):
    """Raw (unshifted) logits [B, T, V] and window K/V [L, 2, B, Hkv, T, D], in float64."""
    state, key_mask, positions = prepare_inputs(state, ids, positions, key_mask, past)
    length = ids.shape[1]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config["hidden_size"] // n_heads
    eps = config.get("rms_norm_eps", 1e-6)
    theta = config.get("rope_theta", 10000.0)
    embedding = state["model.embed_tokens.weight"]

    x = torch.zeros(ids.shape[0], length, embedding.shape[1], dtype=F64)
    for b in range(ids.shape[0]):
        for t in range(length):
            x[b, t] = embedding[int(ids[b, t])]
    layers_kv = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def project(x_row, p=p):
            q = linear(x_row, state[p + "self_attn.q_proj.weight"], state[p + "self_attn.q_proj.bias"])
            k = linear(x_row, state[p + "self_attn.k_proj.weight"], state[p + "self_attn.k_proj.bias"])
            v = linear(x_row, state[p + "self_attn.v_proj.weight"], state[p + "self_attn.v_proj.bias"])
            return (q.reshape(length, n_heads, head_dim), k.reshape(length, n_kv, head_dim),
                    v.reshape(length, n_kv, head_dim))

        h = rms_norm(x, state[p + "input_layernorm.weight"], eps)
        past_layer = None if past is None else (past[0][i, 0], past[0][i, 1])
        attn, kv = attention_layer(
            h, positions, key_mask, past_layer, None if past is None else past[1], project_qkv=project,
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rotary_dim=head_dim, theta=theta,
            out_weight=state[p + "self_attn.o_proj.weight"], out_bias=None, block_length=None)
        x = x + attn
        h = rms_norm(x, state[p + "post_attention_layernorm.weight"], eps)
        x = x + swiglu(h, state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"],
                       state[p + "mlp.down_proj.weight"])
        layers_kv.append(torch.stack(kv))
    h = rms_norm(x, state["model.norm.weight"], eps)
    head = embedding if config.get("tie_word_embeddings") else state["lm_head.weight"]
    return linear(h, head), torch.stack(layers_kv)


def shift(raw: torch.Tensor) -> torch.Tensor:
    """Per-position logits from raw ones [B, T, V]: out[:, j] = raw[:, j - 1], out[:, 0] = raw[:, 0]."""
    out = torch.empty_like(raw)
    for j in range(raw.shape[1]):
        out[:, j] = raw[:, max(j - 1, 0)]
    return out
