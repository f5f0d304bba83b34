"""What every decoder-only model shares: embedding, a slice of decoder layers, final norm, lm_head.

A model is built for a range of layers (a pipeline stage): it holds the embedding only if the range
starts at layer 0 and the norm and lm_head only if it ends at the last layer. The stage runner calls
`embed` (first stage), `forward` (every stage) and `compute_logits` (last stage); the model never
asks which stage it is.

Parameter names are Hugging Face's (`model.layers.{i}.…` with global layer indices), except for the
fused weights listed in `packed_modules`, the stacked experts of `FusedMoE` and the hand-off MLP
(`model.handoff.{i}.…`, read from layer i's tensors); `checkpoint_sources` maps each parameter to
the checkpoint tensors it is loaded from.

The MLP hand-off (`handoff=True`, on a stage after the first): the stage also holds the
post-attention norm and MLP of the previous stage's last layer, which keep no per-sequence state.
For a step the coordinator hands off (`Schedule.mlp_handoff`, chosen by `moemesh.layout.MlpHandoff`
where it evens the stages), the previous stage stops its last layer after the attention
(`forward(..., handoff=True)`) and sends the residual stream as it is then; this stage runs that
layer's MLP first (`finish_handoff`). A prompt chunk costs a stage per layer what a decode costs
per layer and more (no lm_head beside it), so a split that evens decode steps leaves prompt chunks
heavier on the earlier stage: the hand-off moves one MLP of them across.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.config import ModelConfig
from stage_worker.layers.layernorm import RMSNorm
from stage_worker.layers.linear import cpu_gemm_layout, native_pack
from stage_worker.layers.parallel import TPGroup
from stage_worker.layers.vocab import ParallelLMHead, VocabParallelEmbedding


HANDOFF = "handoff"  # the module under `model` holding the hand-off MLP: `model.handoff.{layer}`


class HandoffMLP(nn.Module):
    """The second half of the previous stage's last decoder layer, held by the next stage too: its
    post-attention norm and MLP (dense or MoE), which keep no per-sequence state."""

    def __init__(self, decoder_layer: type[nn.Module], config: ModelConfig, layer_idx: int, tp: TPGroup,
                 quant=None):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = decoder_layer.make_mlp(config, layer_idx, tp, quant)

    def forward(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after the attention [T, H] -> (hidden, residual) after the MLP, as the
        layer itself returns them."""
        return self.mlp(self.post_attention_layernorm(stream)), stream


class CausalLM(nn.Module):
    # module name -> the checkpoint modules fused into it, with the shard id each is loaded as
    packed_modules = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    # our module name -> the checkpoint's, where they differ (Mixtral calls its MoE block block_sparse_moe)
    checkpoint_renames: dict[str, str] = {}
    # (config, layer_idx, tp, quant) -> layer; its classmethod make_mlp(config, layer_idx, tp, quant)
    # builds the layer's MLP alone (for the MLP hand-off)
    decoder_layer: type[nn.Module]

    def __init__(self, config: ModelConfig, layers: range | None = None, tp: TPGroup = TPGroup(), quant=None,
                 handoff: bool = False):
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= config.num_layers):
            raise ValueError(f"layer range {layers.start}:{layers.stop} is outside 0:{config.num_layers}")
        self.config, self.layer_range = config, layers
        self.backend = "torch"  # set_backend
        # the quantization's type for the lm_head (int8), or None: the model dtype
        self.lm_head_weight_type = getattr(quant, "lm_head_weight_type", None)
        self.has_embedding = layers.start == 0
        self.has_head = layers.stop == config.num_layers
        self.model = nn.Module()
        if self.has_embedding:
            self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.model.layers = nn.ModuleDict({str(i): self.decoder_layer(config, i, tp, quant) for i in layers})
        # the layer whose MLP this stage also holds (the MLP hand-off), or None
        self.handoff_layer = layers.start - 1 if handoff and layers.start > 0 else None
        if self.handoff_layer is not None:
            self.model.handoff = nn.ModuleDict({  # (named HANDOFF)
                str(self.handoff_layer): HandoffMLP(self.decoder_layer, config, self.handoff_layer, tp, quant)})
        if self.has_head:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.has_embedding:
                self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, H]"""
        return self.model.embed_tokens(input_ids)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None, handoff: bool = False):
        """This stage's layers: (hidden [T, H], residual [T, H] or None) -> (hidden, residual).
        handoff: the last layer stops after its attention (the next stage runs its MLP)."""
        layers = list(self.model.layers.values())
        for layer in layers[:-1]:
            hidden, residual = layer(hidden, residual)
        return layers[-1](hidden, residual, mlp=not handoff)

    def finish_handoff(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's residual stream [T, H] after its last layer's attention -> (hidden,
        residual) after that layer's MLP, which this stage holds (`handoff=True`)."""
        if self.handoff_layer is None:
            raise ValueError(f"a step hands over the MLP of layer {self.layer_range.start - 1}, which this stage "
                             f"does not hold (it was started without the MLP hand-off)")
        return self.model.handoff[str(self.handoff_layer)](stream)

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Rows to sample from: [N, H] (with their residual) -> logits [N, V] float32."""
        return self.lm_head(self._final_norm(hidden, residual)).float()

    def compute_tokens(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Rows sampled greedily, with nothing to edit or report: [N, H] (with their residual) -> [N]
        int64, each row's first maximum of its logits (compute_logits'); through the lm_head's
        `screen` (which needs `can_screen`), not every logit. Where the model's dtype is not float32
        its logits here are rounded to it, and two that round to one value tie where the screen's
        float32 ones do not: those rows take the logits' own first maximum."""
        normed = self._final_norm(hidden, residual)
        if normed.dtype != torch.float32:
            return self.lm_head(normed).float().max(dim=-1).indices
        return self.lm_head.screen.tokens(normed)

    def _final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]

    @property
    def can_screen(self) -> bool:
        return self.has_head and self.lm_head.screen is not None

    def set_backend(self, backend: str) -> None:
        """Which kernels every layer computes with ("torch" | "native" | "triton", moemesh_kernels.backend);
        before `process_weights_after_loading`, which lays out the weights for them and binds the
        linear and MoE layers' kernels once."""
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend
        self.backend = backend

    def process_weights_after_loading(self) -> None:
        """Every layer's own post-load step (re-layout, packing, quantization), then the lm_head's."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        if not self.has_head:
            return
        wt = self.lm_head_weight_type
        self.lm_head.packed = native_pack(self.backend, self.lm_head.weight.data, wt)
        self.lm_head.screen_packed()
        if self.lm_head.packed is not None:
            if not self.tied:
                del self.lm_head.weight
            return
        w = self.lm_head.weight.data
        if wt == torch.int8:  # the same numbers on torch's path: dequantized once
            from stage_worker.layers.int8 import fake_quantize_int8

            w = fake_quantize_int8(w)
            if self.tied:  # the embedding keeps its own (unquantized) weight
                self.lm_head.weight = nn.Parameter(w, requires_grad=False)
        if not self.tied:
            self.lm_head.weight.data = cpu_gemm_layout(w)

    @property
    def tied(self) -> bool:
        """lm_head and the embedding share one weight (tie_word_embeddings, both on this stage)."""
        return self.has_embedding and self.has_head and self.lm_head.weight is self.model.embed_tokens.weight

    def checkpoint_sources(self, param_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors (name, shard id) that parameter `param_name` is loaded from."""
        renames = {**self.checkpoint_renames, HANDOFF: "layers"}
        rename = lambda name: ".".join(renames.get(p, p) for p in name.split("."))  # noqa: E731
        return [(rename(name), shard) for name, shard in self._sources(param_name)]

    def _sources(self, param_name: str) -> list[tuple[str, object]]:
        module_name, local = param_name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if param_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return [("model.embed_tokens.weight", None)]
        if hasattr(module, "checkpoint_sources"):  # FusedMoE: stacked per-expert tensors
            return [(f"{module_name}.{name}", shard) for name, shard in module.checkpoint_sources(local)]
        parent, _, leaf = module_name.rpartition(".")
        if leaf in self.packed_modules:
            return [(f"{parent}.{src}.{local}", shard) for src, shard in self.packed_modules[leaf]]
        return [(param_name, None)]
