"""A plain, independent float64 reference of the denoiser families' math.

Written from the specification only (not from dlmrt's implementation), working
directly on a `state_dict()` (name -> tensor). Everything is cast to float64 and
spelled out with loops over batch rows, heads, tokens, channel pairs and experts,
so that each step can be checked by reading it.

Conventions shared by both families:
  ids        LongTensor [B, T]
  positions  LongTensor [B, T] (absolute positions of the window's tokens)
  key_mask   BoolTensor [B, P + T] (False: padding key, never attended to)
  past       None, or (kv [L, 2, B, Hkv, P, D], positions [B, P]) of a cached prefix
  residual   None, or (z [B, T, H], certainty [B, T]) of the last ORL step
Each forward returns (logits [B, T, V], kv [L, 2, B, Hkv, T, D]) in float64,
kv holding K after rotary and V of the window.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


# -- small pieces -----------------------------------------------------------------------

def default_positions(key_mask: torch.Tensor) -> torch.Tensor:
    """Each row counts its unpadded tokens from 0 (padded slots get 0)."""
    batch, length = key_mask.shape
    positions = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        seen = 0
        for t in range(length):
            if key_mask[b, t]:
                positions[b, t] = seen
                seen += 1
            else:
                positions[b, t] = max(seen - 1, 0)
    return positions


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    x = x.to(F64)
    mean_square = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(mean_square + eps) * weight.to(F64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = W x (+ b) for x [..., in], W [out, in]."""
    y = x.to(F64) @ weight.to(F64).T
    if bias is not None:
        y = y + bias.to(F64)
    return y


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def softmax(scores: list[float] | torch.Tensor) -> torch.Tensor:
    scores = torch.as_tensor(scores, dtype=F64)
    shifted = scores - scores.max()
    exps = torch.exp(shifted)
    return exps / exps.sum()


def swiglu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def rotate(vector: torch.Tensor, position: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """rotate_half rotary on one head vector: channel pair (j, j + r/2), channels >= r untouched."""
    out = vector.to(F64).clone()
    half = rotary_dim // 2
    for j in range(half):
        inv_freq = 1.0 / (theta ** (2 * j / rotary_dim))
        angle = float(position) * inv_freq
        c, s = math.cos(angle), math.sin(angle)
        x1, x2 = float(vector[j]), float(vector[j + half])
        out[j] = x1 * c - x2 * s
        out[j + half] = x2 * c + x1 * s
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: list[bool]) -> torch.Tensor:
    """One query vector [D] against keys/values [S, D]; softmax(q.k / sqrt(D)) over allowed keys."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    indices = [s for s in range(keys.shape[0]) if allowed[s]]
    if not indices:
        return torch.zeros_like(q)
    scores = [float(torch.dot(q, keys[s])) * scale for s in indices]
    probs = softmax(scores)
    out = torch.zeros(values.shape[-1], dtype=F64)
    for p, s in zip(probs, indices):
        out = out + p * values[s]
    return out


def attention_layer(x, positions, key_mask, past_layer, past_positions, *, project_qkv, n_heads,
                    n_kv_heads, head_dim, rotary_dim, theta, out_weight, out_bias, block_length):
    """Multi-head attention over [prefix keys, window keys] for every row.

    project_qkv(x_row) -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) before rotary.
    Returns (attention output [B, T, H], (K [B, Hkv, T, D] after rotary, V [B, Hkv, T, D])).
    """
    batch, length, _ = x.shape
    group = n_heads // n_kv_heads
    prefix = 0 if past_layer is None else past_layer[0].shape[2]
    outputs = []
    window_k = torch.zeros(batch, n_kv_heads, length, head_dim, dtype=F64)
    window_v = torch.zeros(batch, n_kv_heads, length, head_dim, dtype=F64)
    for b in range(batch):
        q, k, v = project_qkv(x[b])
        q_rot = torch.zeros_like(q)
        k_rot = torch.zeros_like(k)
        for t in range(length):
            pos = int(positions[b, t])
            for h in range(n_heads):
                q_rot[t, h] = rotate(q[t, h], pos, rotary_dim, theta)
            for h in range(n_kv_heads):
                k_rot[t, h] = rotate(k[t, h], pos, rotary_dim, theta)
                window_k[b, h, t] = k_rot[t, h]
                window_v[b, h, t] = v[t, h]
        if prefix:
            key_positions = [int(p) for p in past_positions[b]] + [int(p) for p in positions[b]]
        else:
            key_positions = [int(p) for p in positions[b]]
        row_out = torch.zeros(length, n_heads * head_dim, dtype=F64)
        for t in range(length):
            query_pos = int(positions[b, t])
            allowed = []
            for s in range(prefix + length):
                ok = bool(key_mask[b, s])
                if block_length is not None:
                    ok = ok and (key_positions[s] // block_length <= query_pos // block_length)
                allowed.append(ok)
            for h in range(n_heads):
                kv_head = h // group
                if prefix:
                    keys = torch.cat((past_layer[0][b, kv_head].to(F64), k_rot[:, kv_head]), dim=0)
                    values = torch.cat((past_layer[1][b, kv_head].to(F64), v[:, kv_head]), dim=0)
                else:
                    keys, values = k_rot[:, kv_head], v[:, kv_head]
                row_out[t, h * head_dim:(h + 1) * head_dim] = attend(q_rot[t, h], keys, values, allowed)
        outputs.append(linear(row_out, out_weight, out_bias))
    return torch.stack(outputs), (window_k, window_v)


# -- ORL residual pathway ---------------------------------------------------------------

def adapter_ref(state: dict, prefix: str, kind: str, z: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        inner = linear(z, state[prefix + "residual_adapter.in_proj.weight"])
        return linear(silu(inner), state[prefix + "residual_adapter.out_proj.weight"])
    if kind == "linear":
        return linear(z, state[prefix + "residual_adapter.proj.weight"])
    raise ValueError(kind)


def embed(state: dict, prefix: str, embedding: torch.Tensor, ids, residual, mask_id, adapter_kind):
    """e_i = E[id_i]; masked positions with a residual get E[mask] + w_i * A(z_i)."""
    batch, length = ids.shape
    x = torch.zeros(batch, length, embedding.shape[1], dtype=F64)
    for b in range(batch):
        for t in range(length):
            token = int(ids[b, t])
            x[b, t] = embedding[token].to(F64)
            if residual is not None and token == mask_id:
                z, certainty = residual
                update = adapter_ref(state, prefix, adapter_kind, z[b, t].to(F64))
                x[b, t] = embedding[mask_id].to(F64) + float(certainty[b, t]) * update
    return x


def next_residual_ref(logits: torch.Tensor, embedding: torch.Tensor, topk: int):
    """(z [B, T, H], certainty [B, T]) from logits [B, T, V] and the input embedding [V, H]."""
    batch, length, vocab = logits.shape
    logits = logits.detach().to(F64)
    embedding = embedding.detach().to(F64)
    z = torch.zeros(batch, length, embedding.shape[1], dtype=F64)
    certainty = torch.zeros(batch, length, dtype=F64)
    for b in range(batch):
        for t in range(length):
            p = softmax(logits[b, t].to(F64))
            entropy = 0.0
            for v in range(vocab):
                if p[v] > 0:
                    entropy -= float(p[v]) * math.log(float(p[v]))
            certainty[b, t] = 1.0 - entropy / math.log(vocab)
            if topk and topk < vocab:
                order = sorted(range(vocab), key=lambda v: float(p[v]), reverse=True)[:topk]
                total = sum(float(p[v]) for v in order)
                for v in order:
                    z[b, t] = z[b, t] + (float(p[v]) / total) * embedding[v]
            else:
                for v in range(vocab):
                    z[b, t] = z[b, t] + p[v] * embedding[v]
    return z, certainty


def _adapter_kind(config: dict) -> str | None:
    residual_context = config.get("residual_context")
    if residual_context is None:
        return None
    return residual_context.get("adapter", "mlp")


def prepare_inputs(state: dict, ids, positions, key_mask, past):
    """The state in float64, and the key mask and positions with their defaults filled in."""
    state = {name: tensor.detach().to(F64) for name, tensor in state.items()}
    batch, length = ids.shape
    prefix = 0 if past is None else past[0].shape[4]
    if key_mask is None:
        key_mask = torch.ones(batch, prefix + length, dtype=torch.bool)
    if positions is None:
        if past is not None:
            raise ValueError("positions are required with a cached prefix")
        positions = default_positions(key_mask)
    return state, key_mask, positions


# -- family `llada` ---------------------------------------------------------------------

def llada_forward(state: dict, config: dict, ids, positions=None, key_mask=None, past=None,
                  residual=None, mask_id=None):
    """Logits [B, T, V] and window K/V of the LLaDA (bidirectional) family."""
    state, key_mask, positions = prepare_inputs(state, ids, positions, key_mask, past)
    length = ids.shape[1]
    d = config["d_model"]
    n_heads, n_kv = config["n_heads"], config["n_kv_heads"]
    head_dim = d // n_heads
    eps = config["rms_norm_eps"]
    theta = config["rope_theta"]
    root = "model.transformer."
    wte = state[root + "wte.weight"]

    kind = _adapter_kind(config)
    x = embed(state, root, wte, ids, residual if kind else None, mask_id, kind)
    layers_kv = []
    for i in range(config["n_layers"]):
        p = f"{root}blocks.{i}."

        def project(x_row, p=p):
            q = linear(x_row, state[p + "q_proj.weight"], state.get(p + "q_proj.bias"))
            k = linear(x_row, state[p + "k_proj.weight"], state.get(p + "k_proj.bias"))
            v = linear(x_row, state[p + "v_proj.weight"], state.get(p + "v_proj.bias"))
            return (q.reshape(length, n_heads, head_dim), k.reshape(length, n_kv, head_dim),
                    v.reshape(length, n_kv, head_dim))

        h = rms_norm(x, state[p + "attn_norm.weight"], eps)
        past_layer = None if past is None else (past[0][i, 0], past[0][i, 1])
        attn, kv = attention_layer(
            h, positions, key_mask, past_layer, None if past is None else past[1],
            project_qkv=project, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            rotary_dim=head_dim, theta=theta, out_weight=state[p + "attn_out.weight"],
            out_bias=state.get(p + "attn_out.bias"), block_length=None)
        x = x + attn
        h = rms_norm(x, state[p + "ff_norm.weight"], eps)
        x = x + swiglu(h, state[p + "ff_proj.weight"], state[p + "up_proj.weight"], state[p + "ff_out.weight"])
        layers_kv.append(torch.stack(kv))
    h = rms_norm(x, state[root + "ln_f.weight"], eps)
    if config.get("weight_tying"):
        logits = linear(h, wte)
    else:
        logits = linear(h, state[root + "ff_out.weight"])
    return logits, torch.stack(layers_kv)


# -- family `llada2_moe` ----------------------------------------------------------------

def route(scores: torch.Tensor, bias: torch.Tensor | None, config: dict) -> tuple[list[int], list[float]]:
    """Chosen experts and their weights for one token, from sigmoid router scores [E]."""
    n_experts = scores.shape[0]
    k = config["num_experts_per_tok"]
    choice = [float(scores[e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(n_experts)]
    allowed = [True] * n_experts
    n_group = config.get("n_group") or 1
    if n_group > 1:
        size = n_experts // n_group
        group_scores = []
        for g in range(n_group):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_scores.append(sum(members[:2]))
        kept = sorted(range(n_group), key=lambda g: group_scores[g], reverse=True)[:config["topk_group"]]
        allowed = [(e // size) in kept for e in range(n_experts)]
    candidates = [e for e in range(n_experts) if allowed[e]]
    chosen = sorted(candidates, key=lambda e: choice[e], reverse=True)[:k]
    weights = [float(scores[e]) for e in chosen]
    if config.get("norm_topk_prob") and k > 1:
        total = sum(weights)
        weights = [w / total for w in weights]
    weights = [w * config["routed_scaling_factor"] for w in weights]
    return chosen, weights


def moe_ref(x: torch.Tensor, state: dict, p: str, config: dict, trace: list | None) -> torch.Tensor:
    """The MoE block on x [B, T, H], token by token, expert by expert."""
    out = torch.zeros_like(x)
    router = state[p + "mlp.gate.weight"]
    bias = state[p + "mlp.gate.expert_bias"]
    shared = bool(config.get("num_shared_experts"))
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            token = x[b, t]
            scores = sigmoid(linear(token, router))
            chosen, weights = route(scores, bias, config)
            if trace is not None:
                trace.append({"layer": p, "scores": scores.clone(), "chosen": list(chosen)})
            acc = torch.zeros_like(token)
            for e, w in zip(chosen, weights):
                q = f"{p}mlp.experts.{e}."
                acc = acc + w * swiglu(token, state[q + "gate_proj.weight"], state[q + "up_proj.weight"],
                                       state[q + "down_proj.weight"])
            if shared:
                q = f"{p}mlp.shared_experts."
                acc = acc + swiglu(token, state[q + "gate_proj.weight"], state[q + "up_proj.weight"],
                                   state[q + "down_proj.weight"])
            out[b, t] = acc
    return out


def llada2_forward(state: dict, config: dict, ids, positions=None, key_mask=None, past=None,
                   residual=None, mask_id=None, block_length: int = 32, trace: list | None = None):
    """Logits [B, T, V] and window K/V of the LLaDA2 MoE (block-causal) family."""
    state, key_mask, positions = prepare_inputs(state, ids, positions, key_mask, past)
    length = ids.shape[1]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    rotary_dim = int(head_dim * config.get("partial_rotary_factor", 1.0))
    eps = config["rms_norm_eps"]
    theta = config["rope_theta"]
    embedding = state["model.word_embeddings.weight"]

    kind = _adapter_kind(config)
    x = embed(state, "model.", embedding, ids, residual if kind else None, mask_id, kind)
    layers_kv = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def project(x_row, p=p):
            qkv = linear(x_row, state[p + "attention.query_key_value.weight"],
                         state.get(p + "attention.query_key_value.bias"))
            q = qkv[:, :n_heads * head_dim].reshape(length, n_heads, head_dim)
            k = qkv[:, n_heads * head_dim:(n_heads + n_kv) * head_dim].reshape(length, n_kv, head_dim)
            v = qkv[:, (n_heads + n_kv) * head_dim:].reshape(length, n_kv, head_dim)
            if config.get("use_qk_norm"):
                q_norm = torch.zeros_like(q)
                k_norm = torch.zeros_like(k)
                for t in range(length):
                    for h in range(n_heads):
                        q_norm[t, h] = rms_norm(q[t, h], state[p + "attention.query_layernorm.weight"], eps)
                    for h in range(n_kv):
                        k_norm[t, h] = rms_norm(k[t, h], state[p + "attention.key_layernorm.weight"], eps)
                q, k = q_norm, k_norm
            return q, k, v

        h = rms_norm(x, state[p + "input_layernorm.weight"], eps)
        past_layer = None if past is None else (past[0][i, 0], past[0][i, 1])
        attn, kv = attention_layer(
            h, positions, key_mask, past_layer, None if past is None else past[1],
            project_qkv=project, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            rotary_dim=rotary_dim, theta=theta, out_weight=state[p + "attention.dense.weight"],
            out_bias=state.get(p + "attention.dense.bias"), block_length=block_length)
        x = x + attn
        h = rms_norm(x, state[p + "post_attention_layernorm.weight"], eps)
        if i < config.get("first_k_dense_replace", 0):
            x = x + swiglu(h, state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"],
                           state[p + "mlp.down_proj.weight"])
        else:
            x = x + moe_ref(h, state, p, config, trace)
        layers_kv.append(torch.stack(kv))
    h = rms_norm(x, state["model.norm.weight"], eps)
    if config.get("tie_word_embeddings"):
        logits = linear(h, embedding)
    else:
        logits = linear(h, state["lm_head.weight"])
    return logits, torch.stack(layers_kv)
