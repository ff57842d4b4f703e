"""A plain float64 reference of the SDAR family's forward, written from its description.

SDAR is a Qwen3 stack with block-causal attention. Per layer, on the residual stream x:
  h = RMSNorm(x) * input_layernorm
  q = h Wq (+ bq), k = h Wk (+ bk), v = h Wv (+ bv), in heads of head_dim (biases only with
      attention_bias; GQA: query head i reads K/V head i // group)
  each query head q_i = RMSNorm(q_i) * q_norm, each key head k_j = RMSNorm(k_j) * k_norm
  rotary (rotate_half, all head_dim channels, theta = rope_theta) on q and k at each token's position
  x = x + o_proj(softmax(q.k / sqrt(head_dim) over the allowed keys) . v) (+ o_proj bias)
      a key is allowed when unpadded and its block position // block_length is not after the query's
  x = x + down(silu(gate(h2)) * up(h2)), h2 = RMSNorm(x) * post_attention_layernorm
then logits = lm_head(RMSNorm(x) * norm) (lm_head = embed_tokens when tied); position j's logits
predict token j (no shift).

Built on the float64 pieces of reference_impl.py (loops over rows, heads, tokens and channel
pairs); nothing of dlmrt's model code is used.
"""

from __future__ import annotations

import torch

from reference_impl import F64, attention_layer, linear, prepare_inputs, rms_norm, swiglu


def sdar_forward(state: dict, config: dict, ids, block_length: int, positions=None, key_mask=None, past=None):
    """Logits [B, T, V] and window K/V [L, 2, B, Hkv, T, D], in float64."""
    state, key_mask, positions = prepare_inputs(state, ids, positions, key_mask, past)
    length = ids.shape[1]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config["head_dim"]
    eps = config.get("rms_norm_eps", 1e-6)
    theta = config.get("rope_theta", 10000.0)
    embedding = state["model.embed_tokens.weight"]

    x = torch.zeros(ids.shape[0], length, embedding.shape[1], dtype=F64)
    for b in range(ids.shape[0]):
        for t in range(length):
            x[b, t] = embedding[int(ids[b, t])]
    layers_kv = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."

        def project(x_row, p=p):
            q = linear(x_row, state[p + "q_proj.weight"], state.get(p + "q_proj.bias"))
            k = linear(x_row, state[p + "k_proj.weight"], state.get(p + "k_proj.bias"))
            v = linear(x_row, state[p + "v_proj.weight"], state.get(p + "v_proj.bias"))
            q, k = q.reshape(length, n_heads, head_dim), k.reshape(length, n_kv, head_dim)
            for t in range(length):
                for h in range(n_heads):
                    q[t, h] = rms_norm(q[t, h], state[p + "q_norm.weight"], eps)
                for h in range(n_kv):
                    k[t, h] = rms_norm(k[t, h], state[p + "k_norm.weight"], eps)
            return q, k, v.reshape(length, n_kv, head_dim)

        h = rms_norm(x, state[f"model.layers.{i}.input_layernorm.weight"], eps)
        past_layer = None if past is None else (past[0][i, 0], past[0][i, 1])
        attn, kv = attention_layer(
            h, positions, key_mask, past_layer, None if past is None else past[1], project_qkv=project,
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rotary_dim=head_dim, theta=theta,
            out_weight=state[p + "o_proj.weight"], out_bias=state.get(p + "o_proj.bias"),
            block_length=block_length)
        x = x + attn
        h = rms_norm(x, state[f"model.layers.{i}.post_attention_layernorm.weight"], eps)
        m = f"model.layers.{i}.mlp."
        x = x + swiglu(h, state[m + "gate_proj.weight"], state[m + "up_proj.weight"], state[m + "down_proj.weight"])
        layers_kv.append(torch.stack(kv))
    h = rms_norm(x, state["model.norm.weight"], eps)
    head = embedding if config.get("tie_word_embeddings") else state["lm_head.weight"]
    return linear(h, head), torch.stack(layers_kv)
