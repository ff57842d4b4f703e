"""Tensor parallelism: a loaded denoiser cut, in place, into the part one rank runs.

    check_tensor_split(model, tp)        # before any rank starts: one clear error if tp does not fit
    shard_model(model, ranks)            # in each rank, after loading

Megatron's split, as the field's engines do it (SGLang's `llada2`, vLLM):

- attention: the query heads are split over the ranks, and with them the K/V heads, so each rank
  computes, and caches, its heads' K/V only. With fewer K/V heads than ranks, a K/V head is
  replicated on the ranks whose query heads read it. The output projection is row-parallel: each
  rank multiplies its heads' part, then one all-reduce sums them.
- MLP: gate and up projections column-parallel, the down projection row-parallel: one all-reduce.
  A MoE's experts are cut the same way, each without a collective of its own: the routed sum and
  the shared experts then take one all-reduce for the whole MoE (`AllReduced`).
- LM head: vocabulary-parallel. Each rank's head computes logits for its contiguous vocabulary slice
  only (`VocabShard`), and the unmasking step and the ORL residual reduce that slice to a few numbers
  per position (`dlmrt.parallel.vocab`); no rank ever holds `[B, W, V]` logits. The input embedding
  stays whole on every rank (a lookup needs no collective; a tied head reads a view of its rows).

Routers, norms and the embedding are replicated. After the split every rank holds the same hidden
states after each all-reduce, so every rank takes the same decisions in the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.models import diffusion_gemma, layers, llada, llada2_moe, qwen
from dlmrt.models.experts import SwiGLUExperts
from dlmrt.parallel.experts import ExpertParallelExperts, ExpertParallelMoE
from dlmrt.parallel.ranks import Ranks


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the ranks: each rank's partial product, summed
    by one all-reduce, then the bias once."""

    def __init__(self, linear: nn.Linear, columns: slice, ranks: Ranks):
        super().__init__()
        self.linear = nn.Linear(columns.stop - columns.start, linear.out_features, bias=False,
                                device=linear.weight.device, dtype=linear.weight.dtype)
        self.linear.weight = nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=False)
        self.bias = linear.bias
        self.ranks = ranks

    def forward(self, x: Tensor) -> Tensor:
        out = self.ranks.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


class AllReduced(nn.Module):
    """A module whose output is a partial sum on each rank (a MoE with split experts), summed once."""

    def __init__(self, module: nn.Module, ranks: Ranks):
        super().__init__()
        self.module, self.ranks = module, ranks

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.ranks.all_reduce(self.module(*inputs))


@dataclass(frozen=True)
class HeadSplit:
    """The query and K/V heads one rank keeps."""

    query: range
    kv: range

    def rows(self, heads: range, head_dim: int) -> slice:
        return slice(heads.start * head_dim, heads.stop * head_dim)


def split_heads(query_heads: int, kv_heads: int, world: int, rank: int) -> HeadSplit:
    """Rank `rank`'s heads; K/V heads are replicated when there are fewer than ranks (GQA)."""
    local = query_heads // world
    query = range(rank * local, (rank + 1) * local)
    if kv_heads % world == 0:
        part = kv_heads // world
        return HeadSplit(query, range(rank * part, (rank + 1) * part))
    group = query_heads // kv_heads  # query heads per K/V head; whole multiples of `local` here
    return HeadSplit(query, range(query.start // group, query.start // group + 1))


def vocab_split(vocab_size: int, world: int, rank: int) -> slice:
    """Rank `rank`'s contiguous vocabulary slice: sizes differ by at most one, the larger first."""
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


@dataclass
class VocabShard:
    """A vocabulary-parallel head's slice on this rank: what the step and the residual need to finish
    over the whole vocabulary."""

    rows: slice
    vocab_size: int
    ranks: Ranks

    def unmask(self, logits: Tensor, ids: Tensor, positions: Tensor, params, **options):
        from dlmrt.parallel.vocab import vocab_parallel_unmask

        return vocab_parallel_unmask(logits, ids, positions, params, offset=self.rows.start,
                                     vocab_size=self.vocab_size, gather=self.ranks.all_gather, **options)

    def token_logprobs(self, logits: Tensor, tokens: Tensor, alternatives: int, mask_id: int):
        from dlmrt.parallel.vocab import vocab_parallel_token_logprobs

        return vocab_parallel_token_logprobs(logits, tokens, alternatives, mask_id=mask_id, offset=self.rows.start,
                                             vocab_size=self.vocab_size, gather=self.ranks.all_gather)

    def entropy_bound_step(self, logits: Tensor, canvas: Tensor, positions: Tensor, params, finished: Tensor):
        from dlmrt.parallel.vocab import vocab_parallel_entropy_bound_step

        return vocab_parallel_entropy_bound_step(logits, canvas, positions, params, offset=self.rows.start,
                                                 vocab_size=self.vocab_size, gather=self.ranks.all_gather,
                                                 finished=finished)

    def soft_tokens(self, scaled_logits: Tensor, embedding: Tensor):
        from dlmrt.parallel.vocab import vocab_parallel_soft_tokens

        return vocab_parallel_soft_tokens(scaled_logits, embedding[self.rows], offset=self.rows.start,
                                          vocab_size=self.vocab_size, gather=self.ranks.all_gather,
                                          all_reduce=self.ranks.all_reduce)

    def residual(self, logits: Tensor, embedding: Tensor):
        from dlmrt.parallel.vocab import vocab_parallel_residual

        return vocab_parallel_residual(logits, embedding[self.rows], offset=self.rows.start,
                                       vocab_size=self.vocab_size, gather=self.ranks.all_gather,
                                       all_reduce=self.ranks.all_reduce)


# -- what a split needs -------------------------------------------------------------------------------
def _attention_modules(model: Denoiser) -> list[nn.Module]:
    kinds = (llada.LLaDABlock, llada2_moe.Attention, qwen.Attention, diffusion_gemma.Attention)
    return [m for m in model.modules() if isinstance(m, kinds)]


def _experts_inside(model: Denoiser) -> set[int]:
    """The ids of the modules that make up a MoE's experts (its routed and shared experts)."""
    return {id(part) for moe in model.modules() if isinstance(moe, llada2_moe.MoE)
            for part in moe.modules() if part is not moe}


def _mlp_widths(model: Denoiser, split_experts: bool) -> list[tuple[str, int]]:
    widths = []
    inside = _experts_inside(model)
    for name, module in model.named_modules():
        if not split_experts and (id(module) in inside or isinstance(module, diffusion_gemma.Experts)):
            continue
        if isinstance(module, (layers.SwiGLU, SwiGLUExperts)):
            widths.append((name, module.gate_proj.out_features))
        elif isinstance(module, diffusion_gemma.Experts):
            widths.append((f"{name}.down_proj", module.down_proj.shape[-1]))
        elif isinstance(module, llada.LLaDABlock):
            widths.append((f"{name}.ff_proj", module.ff_proj.out_features))
    return widths


def tp_sizes(model: Denoiser, split_experts: bool = True) -> list[int]:
    """The `--tp` values this model splits into."""
    return [n for n in range(1, 65) if not _split_problems(model, n, split_experts)]


def _split_problems(model: Denoiser, tp: int, split_experts: bool) -> list[str]:
    problems = []
    for module in _attention_modules(model):
        query, kv = module.heads, module.kv_heads
        if query % tp:
            problems.append(f"{query} query heads do not split over {tp} ranks")
        elif kv % tp and tp % kv:
            problems.append(f"{kv} K/V heads neither split over {tp} ranks nor replicate onto them")
    for name, width in _mlp_widths(model, split_experts):
        if width % tp:
            kind = "expert width" if "expert" in name else "MLP width"
            problems.append(f"the {kind} {width} does not split over {tp} ranks")
    if model.vocab_size < tp:
        problems.append(f"the vocabulary ({model.vocab_size}) is smaller than {tp} ranks")
    if model.residual_config is not None and model.residual_config.topk:
        problems.append("the ORL residual over the top-k has no vocabulary-parallel form (topk 0 has)")
    return list(dict.fromkeys(problems))


def check_tensor_split(model: Denoiser, tp: int, split_experts: bool = True) -> None:
    """Raise one ArgumentError if `model` does not split over `tp` ranks, naming the values that do.
    `split_experts=False`: expert parallelism keeps each expert whole on its rank."""
    if tp < 1:
        raise ArgumentError(f"--tp must be at least 1, got {tp}")
    problems = _split_problems(model, tp, split_experts)
    if problems:
        sizes = ", ".join(map(str, tp_sizes(model, split_experts)))
        raise ArgumentError(f"--tp {tp} does not fit {model.name}: {'; '.join(problems)} (--tp values that fit: "
                            f"{sizes})")


# -- the split ------------------------------------------------------------------------------------------
def _keep_rows(linear: nn.Linear, rows: slice | list[slice]) -> None:
    """Keep the output features `rows` of `linear` (column parallelism), in place."""
    parts = rows if isinstance(rows, list) else [rows]
    weight = torch.cat([linear.weight.detach()[part] for part in parts]).clone()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias.detach()[part] for part in parts]).clone(),
                                   requires_grad=False)
    linear.out_features = weight.shape[0]


def _split_swiglu(mlp: layers.SwiGLU, ranks: Ranks, reduce: bool) -> None:
    """Gate and up column-parallel; down row-parallel, reduced here or (reduce=False) by the caller."""
    width = ranks.shard(mlp.gate_proj.out_features)
    _keep_rows(mlp.gate_proj, width)
    _keep_rows(mlp.up_proj, width)
    if reduce:
        mlp.down_proj = RowParallelLinear(mlp.down_proj, width, ranks)
    else:
        mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight.detach()[:, width].clone(), requires_grad=False)
        mlp.down_proj.in_features = width.stop - width.start


def _split_llada_block(block: llada.LLaDABlock, ranks: Ranks) -> None:
    heads = split_heads(block.heads, block.kv_heads, ranks.world, ranks.rank)
    query, kv = heads.rows(heads.query, block.head_dim), heads.rows(heads.kv, block.head_dim)
    _keep_rows(block.q_proj, query)
    _keep_rows(block.k_proj, kv)
    _keep_rows(block.v_proj, kv)
    block.attn_out = RowParallelLinear(block.attn_out, query, ranks)
    block.heads, block.kv_heads = len(heads.query), len(heads.kv)
    width = ranks.shard(block.ff_proj.out_features)
    _keep_rows(block.ff_proj, width)
    _keep_rows(block.up_proj, width)
    block.ff_out = RowParallelLinear(block.ff_out, width, ranks)


def _split_attention(attention: llada2_moe.Attention | qwen.Attention | diffusion_gemma.Attention,
                     ranks: Ranks) -> None:
    heads = split_heads(attention.heads, attention.kv_heads, ranks.world, ranks.rank)
    d = attention.head_dim
    query, kv = heads.rows(heads.query, d), heads.rows(heads.kv, d)
    if isinstance(attention, llada2_moe.Attention):  # one fused projection: [queries | keys | values]
        keys = attention.heads * d
        values = keys + attention.kv_heads * d
        _keep_rows(attention.query_key_value, [query, slice(keys + kv.start, keys + kv.stop),
                                               slice(values + kv.start, values + kv.stop)])
        attention.dense = RowParallelLinear(attention.dense, query, ranks)
    else:
        _keep_rows(attention.q_proj, query)
        _keep_rows(attention.k_proj, kv)
        if hasattr(attention, "v_proj"):  # DiffusionGemma's full layers take V from the raw keys
            _keep_rows(attention.v_proj, kv)
        attention.o_proj = RowParallelLinear(attention.o_proj, query, ranks)
    attention.heads, attention.kv_heads = len(heads.query), len(heads.kv)


def _split_moe(moe: llada2_moe.MoE, ranks: Ranks) -> None:
    """Each routed expert cut like an MLP (gate and up by output rows, down by input columns), as are the
    shared experts, with no collective of their own."""
    width = ranks.shard(moe.experts.gate_proj.out_features)
    for name, rows in (("gate_proj", (slice(None), width)), ("up_proj", (slice(None), width)),
                       ("down_proj", (slice(None), slice(None), width))):
        stacked = getattr(moe.experts, name)
        stacked.weight = nn.Parameter(stacked.weight.detach()[rows].clone(), requires_grad=False)
    moe.experts.gate_proj.out_features = moe.experts.up_proj.out_features = width.stop - width.start
    moe.experts.down_proj.in_features = width.stop - width.start
    if moe.shared_experts is not None:
        _split_swiglu(moe.shared_experts, ranks, reduce=False)


def _split_stacked_experts(experts: diffusion_gemma.Experts, ranks: Ranks) -> None:
    """DiffusionGemma's stacked experts, each cut like an MLP (`gate_up_proj [E, 2I, H]` holds the gate's rows,
    then the up projection's), with no collective of their own."""
    inner = experts.down_proj.shape[-1]
    width = ranks.shard(inner)
    gate_up = experts.gate_up_proj.detach()
    up = slice(inner + width.start, inner + width.stop)
    experts.gate_up_proj = nn.Parameter(torch.cat((gate_up[:, width], gate_up[:, up]), dim=1).clone(),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[:, :, width].clone(), requires_grad=False)


def _untied_head(model: Denoiser) -> nn.Linear | None:
    """The output projection when it is not the embedding (LLaDA names it `transformer.ff_out`)."""
    if isinstance(model, llada.LLaDA):
        return None if model.config.weight_tying else model.model.transformer["ff_out"]
    return getattr(model, "lm_head", None)


def _split_head(model: Denoiser, ranks: Ranks) -> VocabShard:
    rows = vocab_split(model.vocab_size, ranks.world, ranks.rank)
    lm_head = _untied_head(model)
    if lm_head is not None:
        _keep_rows(lm_head, rows)
    else:  # tied: the head reads a view of the embedding's rows (layers.output_logits)
        model.input_embedding().head_rows = rows
    return VocabShard(rows, model.vocab_size, ranks)


def shard_model(model: Denoiser, ranks: Ranks) -> Denoiser:
    """Cut `model` in place into rank `ranks.rank`'s part of a `ranks.world`-way tensor-parallel split. A world
    of one runs the whole split path (every collective over a group of one): what a one-GPU check runs."""
    experts_split = any(isinstance(m, (ExpertParallelMoE, ExpertParallelExperts)) for m in model.modules())
    check_tensor_split(model, ranks.world, split_experts=not experts_split)
    first = _attention_modules(model)[0]
    model.num_kv_heads = len(split_heads(first.heads, first.kv_heads, ranks.world, ranks.rank).kv)
    inside = _experts_inside(model)
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if id(child) in inside or isinstance(child, ExpertParallelExperts):
                    continue  # an expert: its MoE's branch below cuts it, or expert parallelism keeps it whole
                if isinstance(child, llada.LLaDABlock):
                    _split_llada_block(child, ranks)
                elif isinstance(child, ExpertParallelMoE):  # experts whole on their ranks; shared ones split
                    if child.shared_experts is not None:
                        _split_swiglu(child.shared_experts, ranks, reduce=False)
                        child.shared_is_partial = True
                elif isinstance(child, diffusion_gemma.Experts):
                    _split_stacked_experts(child, ranks)
                    setattr(parent, name, AllReduced(child, ranks))
                elif isinstance(child, (llada2_moe.Attention, qwen.Attention, diffusion_gemma.Attention)):
                    _split_attention(child, ranks)
                elif isinstance(child, llada2_moe.MoE):
                    _split_moe(child, ranks)
                    setattr(parent, name, AllReduced(child, ranks))
                elif isinstance(child, layers.SwiGLU):
                    _split_swiglu(child, ranks, reduce=True)
        model.vocab_shard = _split_head(model, ranks)
    return model


__all__ = ["AllReduced", "HeadSplit", "RowParallelLinear", "VocabShard", "check_tensor_split", "shard_model",
           "split_heads", "tp_sizes", "vocab_split"]
