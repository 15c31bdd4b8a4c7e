"""The MLA + MoE transformer that Kimi K2.x (DeepSeek-V3) and GLM-5.x share.

Parameter names equal the Hugging Face checkpoint names, so a checkpoint loads by name. The forward pass works
on a *flattened batch* of new tokens `[N, hidden]`; its `ForwardBatch` (nano/batch.py) says where each row's KV
goes in the paged pool, which rows attend together, and which weights and kernels the pass uses.

Notation in shape comments: N new tokens in the batch, B sequences in an attention group, n new tokens per
sequence of the group, S cached tokens (padded to whole pages), H attention heads, C = kv_lora_rank,
R = qk_rope_head_dim, D = qk_nope_head_dim, V = v_head_dim, E routed experts, K experts per token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nano import kernels
from nano.batch import ForwardBatch
from nano.config import ModelConfig
from nano.quant import Fp8Linear, Int4Linear, PhaseLinear, weight_phase


def attend(q_abs: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
           allowed: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Absorbed MLA attention over gathered cache entries (the PyTorch path).

    q_abs [B, n, H, C], q_pe [B, n, H, R], kv [B, S, C + R], kv_scale [B, S] (FP8) or None, allowed [B, n, S]
    -> [B, n, H, C]. An FP8 token's scale multiplies its scores and its probability, never the cache itself."""
    batch, n, heads, rank = q_abs.shape
    query = torch.cat([q_abs, q_pe], -1).view(batch, n * heads, -1)                   # [B, n*H, C + R]
    scores = torch.bmm(query, kv.transpose(1, 2)).view(batch, n, heads, -1) * softmax_scale   # [B, n, H, S]
    if kv_scale is not None:
        scores = scores * kv_scale[:, None, None, :]
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_abs.dtype)
    if kv_scale is not None:
        probs = probs * kv_scale[:, None, None, :].to(q_abs.dtype)
    latent = kv[..., :rank]                                                             # [B, S, C]
    return torch.bmm(probs.view(batch, n * heads, -1), latent).view(batch, n, heads, rank)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32, round to the model dtype, then scale (the reference order)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


# ---- rotary position embedding -------------------------------------------------------------------------------

def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin amplitude (YaRN's attention factor, 1.0 otherwise).

    YaRN keeps high-frequency pairs (short wavelengths, well inside the original context) as they were and
    divides low-frequency pairs by `factor`, with a linear ramp between the pair indices where the wavelength
    makes `beta_fast` and `beta_slow` rotations over the original context. Kimi sets both betas to 1, so the
    ramp is about one pair wide.
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    yarn = cfg.rope_scaling
    if not yarn:
        return inv_freq, 1.0
    factor, orig = yarn["factor"], yarn["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        m, m_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def pair_for_rotations(rotations: float) -> float:  # the pair index whose wavelength fits `rotations` in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_for_rotations(yarn.get("beta_fast") or 32), pair_for_rotations(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                  # 1 = keep the original (extrapolate), 0 = divide by factor
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x [..., R] by position; cos/sin broadcast to [..., R/2].

    Interleaved (DeepSeek/GLM-5 weights) pairs dims (0,1), (2,3), ...; split-half pairs (i, i + R/2). Either
    way the result is written split-half: queries and keys get the same permutation, so dot products are
    unchanged and the cache stores rope keys in this layout."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---- attention ---------------------------------------------------------------------------------------------

class Indexer(nn.Module):
    """DeepSeek Sparse Attention indexer (GLM-5.x): picks, for every query, the `index_topk` keys to attend to.

    index_score[s] = sum_h relu(q_h . k_s / sqrt(Di)) * w_h,  with w = weights_proj(x) / sqrt(Hi)
    q comes from the MLA query latent, k is one LayerNormed key per token (cached like the latent). Both rotate
    their first R dims in the indexer's own RoPE layout (`indexer_rope_interleave`), which need not be MLA's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk, self.interleaved = cfg.index_topk, cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., Di] with its first R dims rotated (cos/sin broadcast to [..., R/2]), the rest as they were."""
        return torch.cat([apply_rope(x[..., :self.rope_dim], cos, sin, self.interleaved), x[..., self.rope_dim:]], -1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> the keys to cache [N, Di]."""
        return self.rope(self.k_norm(self.wk(x)), cos, sin)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x [B, n, hidden], q_latent [B, n, q_lora], keys [B, S, Di], allowed [B, n, S] -> the keys each query
        may attend to [B, n, S]: the top-k allowed keys by index score."""
        batch, n = x.shape[:2]
        q = self.wq_b(q_latent).view(batch, n, self.n_heads, self.head_dim)            # [B, n, Hi, Di]
        q = self.rope(q, cos[..., None, :], sin[..., None, :])
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(1, 2)[:, None])
                        * self.head_dim ** -0.5)                                        # [B, n, Hi, S]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        index_scores = torch.matmul(weights[..., None, :], scores).squeeze(-2)         # [B, n, S]
        index_scores = index_scores.masked_fill(~allowed, float("-inf"))
        # a stable sort breaks ties (keys whose every head is relu'd to 0) by position, so the choice does not
        # depend on how the prompt was chunked or batched
        top = index_scores.sort(dim=-1, descending=True, stable=True).indices[..., :self.topk]   # [B, n, k]
        return torch.zeros_like(allowed).scatter_(-1, top, True) & allowed


class MLAttention(nn.Module):
    """Multi-head latent attention, computed in the absorbed form over the latent cache.

    Per token the cache keeps only c = RMSNorm(kv_a(x)[:C]) and the rotated shared rope key k_pe — C + R values
    (576 for Kimi and GLM-5) instead of H * (D + R + V) for expanded keys and values. kv_b_proj maps c to every
    head's key part k_nope = W_UK c and value v = W_UV c; instead of expanding, fold W_UK into the query
    (q~ = q_nope W_UK, a C-vector per head) and W_UV into the output:
        score_h(s) = (q~_h . c_s + q_pe_h . k_pe_s) * scale,   out_h = W_UV (sum_s p_h(s) c_s)
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads   # this device's heads: fewer under tensor parallelism (nano/parallel.py)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg) if cfg.has_indexer and cfg.indexer_types[layer] == "full" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                selections: list[torch.Tensor | None]) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]. `selections` holds each group's DSA key mask [B, n, S] (None = every
        allowed key); full indexer layers overwrite it, shared layers reuse what the last full layer chose."""
        cfg, pool, n_tok = self.cfg, batch.pool, x.shape[0]
        heads, nope, rank = self.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))                            # [N, q_lora]
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = None, self.q_proj(x)
        q = q.view(n_tok, heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], cos[:, None], sin[:, None], cfg.rope_interleave)
        kv = self.kv_a_proj_with_mqa(x)                                                # [N, C + R]
        pool.write(self.layer, batch.slots, self.kv_a_layernorm(kv[:, :rank]),
                   apply_rope(kv[:, rank:], cos, sin, cfg.rope_interleave))
        if self.indexer is not None:
            pool.write_index(self.layer, batch.slots, self.indexer.keys(x, cos, sin))

        w_kv = self.kv_b_proj.weight.view(heads, nope + cfg.v_head_dim, rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]                                    # [H, D, C], [H, V, C]
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)                # [N, H, C]
        out = torch.empty(n_tok, heads, rank, dtype=x.dtype, device=x.device)
        for g, group in enumerate(batch.groups):
            shape, table = (group.batch, group.num_new), group.page_table
            if self.indexer is not None:
                # with every sequence <= index_topk tokens, every allowed key is selected: skip the scoring
                selections[g] = None if group.max_len <= self.indexer.topk else self.indexer.select(
                    x[group.rows].view(*shape, -1), q_latent[group.rows].view(*shape, -1),
                    cos[group.rows].view(*shape, -1), sin[group.rows].view(*shape, -1),
                    pool.gather_index(self.layer, table, x.dtype), group.allowed)
            if batch.use_kernels and group.num_new == 1 and selections[g] is None:
                # the GPU path: read the pages in place (every layout), dequantizing in registers
                part = {name: pool.data[name][self.layer] for name in ("kv_scale", "rope") if name in pool.data}
                out[group.rows] = kernels.mla_decode_paged(
                    q_abs[group.rows], q_pe[group.rows], pool.kv[self.layer], part.get("kv_scale"), table.int(),
                    group.seq_lens.int(), cfg.softmax_scale, rope_pages=part.get("rope"))
                continue
            cache, cache_scale = pool.gather(self.layer, table, x.dtype)               # [B, S, C + R], [B, S]
            allowed = group.allowed if selections[g] is None else selections[g]
            out[group.rows] = attend(q_abs[group.rows].view(*shape, heads, rank),
                                     q_pe[group.rows].view(*shape, heads, -1), cache, cache_scale, allowed,
                                     cfg.softmax_scale).reshape(-1, heads, rank)
        attn = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))                    # [H, N, V]
        attn = attn.transpose(0, 1).reshape(n_tok, heads * cfg.v_head_dim)
        return self.o_proj(attn)


# ---- feed-forward ------------------------------------------------------------------------------------------

class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Dense layers, shared experts and each routed expert.

    When gate and up are plain matrices they run as one matmul over [gate; up] (one read of x, one call instead of
    two): the two parameters become views of one [2I, hidden] tensor, so nothing is held twice and the
    checkpoint names stay. Quantized projections (Int4Linear, Fp8Linear, PhaseLinear) run one call each."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self._gate_up: torch.Tensor | None = None

    def gate_up(self) -> torch.Tensor | None:
        """[2I, hidden]: gate's rows, then up's, with gate_proj.weight and up_proj.weight views of it; None when
        either is not a plain bias-free Linear. Built on first use (after loading and conversion) and again if a
        weight was replaced since."""
        gate, up, fused = self.gate_proj, self.up_proj, self._gate_up
        if not (type(gate) is type(up) is nn.Linear and gate.bias is None and up.bias is None):
            return None
        if fused is None or gate.weight.data_ptr() != fused.data_ptr() or up.weight.data_ptr() != fused[
                gate.out_features:].data_ptr() or fused.dtype != gate.weight.dtype:
            fused = self._gate_up = torch.cat([gate.weight, up.weight])
            gate.weight = nn.Parameter(fused[:gate.out_features], requires_grad=False)
            up.weight = nn.Parameter(fused[gate.out_features:], requires_grad=False)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up()
        if gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        h = F.linear(x, gate_up)                                                        # [M, 2I]
        inner = h.shape[-1] // 2
        return self.down_proj(F.silu(h[..., :inner]) * h[..., inner:])


class Router(nn.Module):
    """DeepSeek-V3 `noaux_tc` routing, all in fp32.

    sigmoid scores pick experts only after adding e_score_correction_bias (a load-balancing bias that never
    touches the weights); with n_group > 1 only the `topk_group` groups with the best top-2 sums compete;
    the chosen experts' *unbiased* scores are renormalised (norm_topk_prob) and scaled."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (expert ids [N, K], weights [N, K] fp32)."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                     # [N, E]
        choice = scores + self.e_score_correction_bias
        if cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)                          # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)                        # [N, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        expert_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices  # [N, K]
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self._packed: dict[bool, dict | None] = {}   # by phase (decode or not)
        # Under expert parallelism (nano/parallel.py) this device holds experts [expert_offset, expert_offset + L)
        # only; the others' entries are None and their routes contribute nothing here.
        self.expert_offset = 0

    def packed_experts(self, decode: bool) -> dict | None:
        """The experts this phase runs, stacked for the fused kernel, when every one is INT4 in the compressed-tensors
        layout or every one is FP8 blocks (a `PhaseLinear` contributes its `decode` or `prefill` side): the keyword
        arguments of `kernels.fused_moe` after the routing — w13 [E, 2I, ...] (gate rows, then up), its scales,
        w2 [E, H, ...], its scales, and the format. Built once per phase, after the weights took their formats; each
        expert's buffers then become views into the stacks, so nothing is held twice."""
        if decode in self._packed:
            return self._packed[decode]
        def phase_side(linear: nn.Module) -> nn.Module:
            if isinstance(linear, PhaseLinear):
                return linear.decode if decode else linear.prefill
            return linear
        experts = [[phase_side(getattr(e, name)) for name in ("gate_proj", "up_proj", "down_proj")]
                   for e in self.experts if e is not None]
        projections = [p for trio in experts for p in trio]
        inner = experts[0][0].out_features
        if all(isinstance(p, Int4Linear) and not p.cpu_tiled for p in projections):
            names = ("weight_packed", "weight_scale")
            fmt = dict(weight_format="int4", group_size=projections[0].group_size)
        elif all(isinstance(p, Fp8Linear) and p.block_size == projections[0].block_size for p in projections) and \
                inner % projections[0].block_size[0] == 0 and projections[0].kernel_block_k is not None:
            # (gate | up stacked along N keep whole scale blocks only when I is a multiple of the block's rows)
            names = ("weight", "weight_scale_inv")
            fmt = dict(weight_format="fp8", fp8_block=projections[0].block_size,
                       block_k=projections[0].kernel_block_k)
        else:
            self._packed[decode] = None
            return None
        w13, w13_scale = (torch.stack([torch.cat([getattr(gate, n), getattr(up, n)]) for gate, up, _ in experts])
                          for n in names)
        w2, w2_scale = (torch.stack([getattr(down, n) for _, _, down in experts]) for n in names)
        scale_rows = w13_scale.shape[1] // 2                                            # gate's scale rows
        for i, (gate, up, down) in enumerate(experts):
            for name, stack, split in ((names[0], w13, inner), (names[1], w13_scale, scale_rows)):
                setattr(gate, name, stack[i, :split])
                setattr(up, name, stack[i, split:])
            setattr(down, names[0], w2[i])
            setattr(down, names[1], w2_scale[i])
        self._packed[decode] = dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, **fmt)
        return self._packed[decode]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        expert_ids, weights = self.gate(x)                                              # [N, K]
        packed = self.packed_experts(batch.decode) if batch.use_kernels else None
        if packed is not None:
            local = packed["w13"].shape[0]
            if local < len(self.experts):   # routes to other devices' experts: weight 0, any local id
                local_ids = expert_ids - self.expert_offset
                mine = (local_ids >= 0) & (local_ids < local)
                expert_ids, weights = local_ids.clamp(0, local - 1), weights * mine
            routed = kernels.fused_moe(x, topk_ids=expert_ids, topk_weights=weights, **packed)
            return routed if self.shared_experts is None else routed + self.shared_experts(x)
        # Sort the (token, expert) pairs by expert: each chosen expert then runs once, as one matmul over all the
        # rows routed to it, so its weights are read once per step however many tokens chose it. A decode step of
        # 64 requests reads each expert once for its ~16 rows instead of once per row: the batch rides on the reads.
        num_chosen = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)                              # [N * K]
        counts = torch.bincount(expert_ids.flatten(), minlength=len(self.experts)).tolist()
        token = order // num_chosen
        x_sorted = x.index_select(0, token)                                             # [N * K, hidden]
        out, start = torch.zeros_like(x_sorted), 0
        for expert, count in enumerate(counts):
            module = self.experts[expert]                                               # None: not on this device
            if count and module is not None:
                out[start:start + count] = module(x_sorted[start:start + count])
            start += count
        weighted = out * weights.flatten()[order, None]                                 # [N * K, hidden] fp32
        routed = torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


# ---- the model ---------------------------------------------------------------------------------------------

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.mlp_layer_types[layer] == "sparse" else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                selections: list[torch.Tensor | None]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, selections)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch) if isinstance(self.mlp, MoE) else self.mlp(h))


class Body(nn.Module):
    """Named `model` inside `Transformer`, so parameter names match checkpoints (`model.layers.3...`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # given its (uninitialised) weight: Embedding's own random init would import torch._dynamo (~2 s per process)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 materialize: bool = True) -> None:
        """The model with uninitialised weights on `device` (fill them with init_random or the loader), or, with
        `materialize=False`, with weights of the right shapes and dtypes on the meta device: the loader then allocates
        each as it reads it, in the format the checkpoint holds (an FP8 checkpoint never exists in BF16)."""
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):  # shapes only: weights come from a checkpoint or init_random, never twice
            self.model = Body(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hold_weights_in(dtype)
        if materialize:
            self.to_empty(device=device)
        self.tie_embeddings()
        inv_freq, self.rope_amplitude = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.requires_grad_(False)

    def tie_embeddings(self) -> None:
        """With tie_word_embeddings, the lm_head is the embedding matrix (after loading, too)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hold_weights_in(self, dtype: torch.dtype) -> None:
        """Every weight in `dtype` but the routers' (fp32, as in the reference); the activations follow the
        embedding's dtype. Quantized codes and scales are buffers and keep their formats. (llm.compute_dtype:
        a bfloat16 model on a CPU without bf16 matmuls is widened to float32 after loading.)"""
        for name, param in self.named_parameters():
            if not name.endswith(("gate.weight", "e_score_correction_bias")):
                param.data = param.data.to(dtype)

    @property
    def device(self) -> torch.device:
        """Where the model computes (its weights may still be on the meta device, before loading)."""
        return self.inv_freq.device

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Seeded random weights (for the nano presets): normal(0, std) matrices, unit norms, a small
        random router bias so that selection-only biasing is visible."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.data.copy_(torch.rand(param.shape, generator=gen) * 0.1)
            elif param.dim() == 1:
                param.data.fill_(0.0 if name.endswith("bias") else 1.0)
            elif param.dtype == torch.float32:   # drawn in place: the values of randn(shape) * std, 8x faster
                param.data.normal_(0.0, std, generator=gen)
            else:                                # drawn in float32 (the same values at every dtype), then rounded
                param.data.copy_(torch.empty(param.shape).normal_(0.0, std, generator=gen))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> logits [len(logits_rows) or N, vocab] (fp32). Layers held in two formats
        (`PhaseLinear`) run the side `batch.decode` names."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]                    # [N, R/2]
        x = self.model.embed_tokens(input_ids)
        cos = (freqs.cos() * self.rope_amplitude).to(x.dtype)
        sin = (freqs.sin() * self.rope_amplitude).to(x.dtype)
        selections: list[torch.Tensor | None] = [None] * len(batch.groups)
        with weight_phase(batch.decode):
            for layer in self.model.layers:
                x = layer(x, cos, sin, batch, selections)
            if logits_rows is not None:
                x = x[logits_rows]
            return self.lm_head(self.model.norm(x)).float()
