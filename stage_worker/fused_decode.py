"""Decode steps in one native call for a stage's decoder layers (kernels/cpu_gemm.c `mm_decoder_layers`).

The model files say what a layer computes, op by op, and run every step that is not a pure decode
(prefill chunks, tensor parallelism, other backends). A decode step of a small batch is dominated by
what sits around the kernels, not by them: ~40 torch ops and ~30 Python calls per layer (docs/
benchmarks.md). So when a stage runs on the native backend with one tensor rank, float32
activations and packed weights everywhere, each decoder layer is described once to the C library
(pointers into the layer's own packed weights, norms and KV cache) and a decode step runs them all
in one call. It computes with the same kernels in the same order as the op-by-op path.
"""

from __future__ import annotations

import torch

from moemesh_kernels import cpu_gemm
from stage_worker.context import ForwardContext, build_context
from stage_worker.layers.fused_moe import FusedMoE
from stage_worker.models.base import CausalLM
from stage_worker.models.llama import LlamaMLP


class _Float32:
    """float32 views of a layer's small tensors (norm weights, biases), copied when the model runs
    in bfloat16; the copies live as long as the descriptions that point at them."""

    def __init__(self):
        self.keep: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self.keep.append(t)
        return t

    def ptr(self, t: torch.Tensor) -> int:
        return self(t).data_ptr()


def _layer_desc(layer, f32: _Float32) -> cpu_gemm.LayerDesc | None:
    """The C description of one decoder layer, or None if it has a part the fused path lacks."""
    attn, mlp = layer.self_attn, layer.mlp
    _bias = lambda linear: f32(linear.bias)  # noqa: E731
    if attn.qkv_proj.packed is None or attn.o_proj.packed is None:
        return None
    kv = attn.attn.kv_cache
    if kv is None or kv.dtype not in (torch.float32, torch.bfloat16) or attn.rotary_emb.cos.dtype != torch.float32:
        return None
    d = cpu_gemm.LayerDesc()
    d.hidden, d.heads, d.kv_heads, d.head_dim = (layer.input_layernorm.weight.numel(), attn.num_heads,
                                                 attn.num_kv_heads, attn.head_dim)
    d.eps = layer.input_layernorm.eps
    d.in_norm, d.post_norm = f32.ptr(layer.input_layernorm.weight), f32.ptr(layer.post_attention_layernorm.weight)
    if attn.qk_norm:
        d.q_norm, d.k_norm, d.qk_eps = f32.ptr(attn.q_norm.weight), f32.ptr(attn.k_norm.weight), attn.q_norm.eps
    d.qkv = cpu_gemm.weight_desc(attn.qkv_proj.packed, _bias(attn.qkv_proj))
    d.o = cpu_gemm.weight_desc(attn.o_proj.packed, _bias(attn.o_proj))
    d.cos, d.sin = attn.rotary_emb.cos.data_ptr(), attn.rotary_emb.sin.data_ptr()
    assert attn.qkv_proj.packed.n == (d.heads + 2 * d.kv_heads) * d.head_dim
    d.k_cache, d.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
    d.kv_type, d.block_size = cpu_gemm.WEIGHT_TYPES[kv.dtype], kv.shape[2]
    if isinstance(mlp, LlamaMLP):
        if mlp.gate_up_proj.packed is None or mlp.down_proj.packed is None:
            return None
        d.moe = 0
        d.gate_up = cpu_gemm.weight_desc(mlp.gate_up_proj.packed, _bias(mlp.gate_up_proj))
        d.down = cpu_gemm.weight_desc(mlp.down_proj.packed, _bias(mlp.down_proj))
        return d
    experts: FusedMoE = mlp.experts
    if experts.packed is None or mlp.gate.packed is None or mlp.gate.packed.n != experts.num_local_experts:
        return None  # (expert parallelism: the router sees every expert, this rank holds some)
    d.moe = 1
    d.router = cpu_gemm.weight_desc(mlp.gate.packed, _bias(mlp.gate))
    w13, w2 = experts.packed
    for w in (w13, w2):
        cpu_gemm.check_layout(w, cpu_gemm.native())
    d.experts, d.top_k, d.expert_offset = experts.num_local_experts, experts.top_k, experts.expert_offset
    d.moe_intermediate, d.renormalize, d.moe_wt = w2.k, int(experts.renormalize), w13.weight_type
    d.moe_wt2 = w2.weight_type
    d.w13, d.w2 = w13.data.data_ptr(), w2.data.data_ptr()
    d.s13, d.s2 = cpu_gemm._ptr(w13.scale), cpu_gemm._ptr(w2.scale)
    if mlp.shared_expert is not None:
        shared = mlp.shared_expert
        if shared.gate_up_proj.packed is None or shared.down_proj.packed is None or \
                mlp.shared_expert_gate.packed is None:
            return None
        d.gate_up = cpu_gemm.weight_desc(shared.gate_up_proj.packed, _bias(shared.gate_up_proj))
        d.down = cpu_gemm.weight_desc(shared.down_proj.packed, _bias(shared.down_proj))
        d.shared_gate = cpu_gemm.weight_desc(mlp.shared_expert_gate.packed, _bias(mlp.shared_expert_gate))
    return d


def _packed_tensors(module) -> list[torch.Tensor]:
    packed = getattr(module, "packed", None)
    items = packed if isinstance(packed, tuple) else (packed,) if packed is not None else ()
    return [t for p in items for t in (p.data, p.scale) if t is not None]


class FusedDecode:
    """A stage's decoder layers as C descriptions; `FusedDecode.build` is None where any layer
    cannot take the fused path (the runner then runs every step op by op).

    Activations are float32 inside, whatever the model dtype: a bfloat16 model keeps its weights
    and KV cache in bfloat16 (the bytes a decode step reads) and computes in float32 between them,
    as llama.cpp computes with BF16 weights; its hidden state leaves the stage in bfloat16. (On a
    CPU with AVX512-BF16 a product of more than three rows rounds its input to bfloat16, as
    llama.cpp's does: kernels/README.md.)"""

    def __init__(self, model: CausalLM, descs: list[cpu_gemm.LayerDesc], keep: _Float32, dtype: torch.dtype):
        self.model, self.keep, self.dtype = model, keep, dtype
        self.descs = (cpu_gemm.LayerDesc * len(descs))(*descs)  # (copies of the structs: the same pointers)
        self.lib = cpu_gemm.native()
        self.hidden_size = descs[0].hidden
        # the last stage's final norm (float32) and packed lm_head, for `logits`; None: op by op
        self.head = None
        if model.has_head and model.lm_head.packed is not None:
            self.head = (keep(model.model.norm.weight), model.model.norm.eps, model.lm_head.packed,
                         model.config.vocab_size)
        # the embedding, for `greedy` on a stage that holds the whole model
        self.embed = model.model.embed_tokens.weight if model.has_embedding else None
        # what the descriptions point into, held here as well as by the layers
        self.pinned = [t for m in model.modules() for t in _packed_tensors(m)]
        self.pinned += [m.attn.kv_cache for m in (layer.self_attn for layer in model.model.layers.values())]

    @classmethod
    def build(cls, model: CausalLM, tp_size: int, dtype: torch.dtype) -> "FusedDecode | None":
        if model.backend != "native" or tp_size != 1 or dtype not in (torch.float32, torch.bfloat16):
            return None
        keep = _Float32()
        descs = [_layer_desc(layer, keep) for layer in model.model.layers.values()]
        if any(d is None for d in descs):
            return None
        return cls(model, descs, keep, dtype)

    def forward(self, ctx: ForwardContext, hidden: torch.Tensor, residual: torch.Tensor | None, stream: bool = False,
                owned: bool = False):
        """A pure decode step (ctx has one decode group, one token per sequence): (hidden, residual)
        through every layer of the stage. stream: return the residual stream instead, hidden +
        residual added in float32 and rounded to the model's dtype once. owned: hidden is the
        caller's to overwrite (the embedding's fresh output)."""
        hidden, residual = self._layers(ctx, hidden, residual, owned)
        if stream:
            return (hidden + residual).to(self.dtype)
        return hidden.to(self.dtype), residual.to(self.dtype)

    def logits(self, ctx: ForwardContext, hidden: torch.Tensor, residual: torch.Tensor | None,
               owned: bool = False) -> torch.Tensor:
        """The last stage's pure decode step, every row sampled: logits [T, V] float32. The final norm
        and the lm_head take the layers' float32 output as it is; in float32 this is what the op-by-op
        head computes (the same kernels on the same values); in bfloat16 nothing is rounded to
        bfloat16 on the way but what the lm_head's product itself rounds (see the class; the op-by-op
        head rounds the layers' output, their sum, the normed row and the logits), as llama.cpp
        computes its head."""
        packed, vocab = self.head[2:]
        logits = cpu_gemm.gemm(self._normed(ctx, hidden, residual, owned), packed, self.lib)
        return logits if packed.n == vocab else logits[:, :vocab]

    def tokens(self, ctx: ForwardContext, hidden: torch.Tensor, residual: torch.Tensor | None,
               owned: bool = False) -> torch.Tensor:
        """As `logits`, every row sampled greedily with nothing to edit or report: [T] int64, the
        first maximum of each row's logits, through the lm_head's screen (`can_screen`)."""
        return self.model.lm_head.screen.tokens(self._normed(ctx, hidden, residual, owned))

    def _normed(self, ctx: ForwardContext, hidden: torch.Tensor, residual: torch.Tensor | None, owned: bool):
        """Every layer, then the final norm: what the lm_head takes, float32."""
        weight, eps = self.head[:2]
        hidden, residual = self._layers(ctx, hidden, residual, owned)
        return cpu_gemm.rms_norm(hidden, weight, eps, residual, self.lib)[0]

    @property
    def can_greedy(self) -> bool:
        """Whether `greedy` can run here: the stage holds the whole model, its head packed."""
        return (self.head is not None and self.embed is not None and self.embed.dtype in (torch.float32, torch.bfloat16)
                and self.head[3] <= self.embed.shape[0])  # (every token sampled is a row of the embedding)

    def greedy(self, tokens: list[int], context_lens: list[int], block_tables: list[list[int]], steps: int,
               block_size: int, limits: tuple[int, int]) -> list[list[int]]:
        """`steps` greedy decode steps of the whole model in one native call, each feeding back the
        tokens the one before sampled (kernels/cpu_gemm.c `mm_greedy_decode`): what `steps` runs of
        the runner's decode step and the sampler's argmax compute, in the same order. tokens[i]: the
        next input of sequence i, at position context_lens[i]; its block table covers the positions
        up to context_lens[i] + steps - 1. -> [steps][S] tokens sampled. Every index is checked
        first (ValueError, or IndexError for a table too short), against limits (KV blocks, rotary
        positions) as build_context checks a step's."""
        weight, eps, packed, vocab = self.head
        if steps < 1 or len(tokens) != len(context_lens):
            raise ValueError(f"{steps} steps of {len(tokens)} tokens at {len(context_lens)} positions")
        if any(not 0 <= t < self.embed.shape[0] for t in tokens):
            raise ValueError(f"a token outside the embedding's {self.embed.shape[0]} rows")
        if min(context_lens, default=0) < 0:
            raise ValueError("a KV slot or position of this step is outside the cache or the rotary table")
        # with the first positions at least 0, the last step's context checks them all: its positions
        # are the highest, its tables the longest
        last = build_context([1] * len(tokens), [c + steps - 1 for c in context_lens], block_tables, block_size,
                             "cpu", limits)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        out = cpu_gemm.greedy_decode(self.descs, self.embed, weight, eps, packed, vocab, as_long(tokens),
                                     as_long(context_lens), last.groups[0].block_table, block_size, steps, self.lib,
                                     self.model.lm_head.screen)
        return out.tolist()

    def _layers(self, ctx: ForwardContext, hidden: torch.Tensor, residual: torch.Tensor | None, owned: bool):
        """(hidden, residual) through every layer, float32 out."""
        group = ctx.groups[0]
        T = ctx.positions.shape[0]
        # the step's indices were checked by build_context (the runner's limits); the rows are checked here
        if hidden.shape != (T, self.hidden_size) or (residual is not None and residual.shape != hidden.shape):
            raise ValueError(f"activations {tuple(hidden.shape)} for a step of {T} tokens")
        x = hidden.float().contiguous()  # the layers work in place: on a copy unless hidden is ours
        hidden = x if owned or x is not hidden else x.clone()
        first = residual is None
        residual = torch.empty_like(hidden) if first else residual.float().contiguous().clone()
        cpu_gemm.decoder_layers(self.descs, hidden, residual, first, ctx.positions, ctx.slot_mapping,
                                group.block_table, group.kv_len, self.lib)
        return hidden, residual
