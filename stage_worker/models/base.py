"""What every decoder-only model shares: embedding, a slice of decoder layers, final norm, lm_head.

A model is built for a range of layers (a pipeline stage): it holds the embedding only if the range
starts at layer 0 and the norm and lm_head only if it ends at the last layer. The stage runner calls
`embed` (first stage), `forward` (every stage) and `compute_logits` (last stage); the model never
asks which stage it is.

Parameter names are Hugging Face's (`model.layers.{i}.…` with global layer indices), except for the
fused weights listed in `packed_modules`, the stacked experts of `FusedMoE` and the hand-off MLP
(`model.handoff.{i}.…`, read from layer i's tensors); `checkpoint_sources` maps each parameter to
the checkpoint tensors it is loaded from.

The MLP hand-off (`handoff=True`, a stage after the first): the stage also holds the post-attention
norm and MLP of the previous stage's last layer, which keep no per-sequence state. Each step, the
previous stage runs that MLP for the first `mlp_rows` tokens (`forward(..., mlp_rows)`) and sends
the others on with their residual stream after the attention; `finish_handoff` runs the MLP for
them here. How many go which way is the coordinator's choice per step (`coordinator.balance`), so
that the two stages are equally busy whatever the step holds (prompt chunks or decodes).
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
    post-attention norm and MLP (dense or MoE), which hold no per-sequence state. Each step, the
    previous stage runs that MLP for some of the step's tokens and hands the others over with their
    residual stream after the attention; this finishes them (`CausalLM.finish_handoff`)."""

    def __init__(self, decoder_layer: type[nn.Module], config: ModelConfig, layer_idx: int, tp: TPGroup,
                 quant=None):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = decoder_layer.make_mlp(config, layer_idx, tp, quant)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention [N, H] -> after the MLP."""
        return stream + self.mlp(self.post_attention_layernorm(stream))


class CausalLM(nn.Module):
    # module name -> the checkpoint modules fused into it, with the shard id each is loaded as
    packed_modules = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    # our module name -> the checkpoint's, where they differ (Mixtral calls its MoE block block_sparse_moe)
    checkpoint_renames: dict[str, str] = {}
    decoder_layer: type[nn.Module]  # (config, layer_idx, tp, quant) -> layer

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
        self.handoff_layer = layers.start - 1 if handoff and layers.start > 0 else None
        if self.handoff_layer is not None:
            setattr(self.model, HANDOFF, nn.ModuleDict({
                str(self.handoff_layer): HandoffMLP(self.decoder_layer, config, self.handoff_layer, tp, quant)}))
        if self.has_head:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.has_embedding:
                self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, H]"""
        return self.model.embed_tokens(input_ids)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None, mlp_rows: int | None = None):
        """This stage's layers: (hidden [T, H], residual [T, H] or None) -> (hidden, residual).
        mlp_rows: the last layer's MLP runs for the first mlp_rows tokens only (the MLP hand-off);
        the others leave with hidden 0."""
        layers = list(self.model.layers.values())
        for layer in layers[:-1]:
            hidden, residual = layer(hidden, residual)
        return layers[-1](hidden, residual, mlp_rows)

    def finish_handoff(self, stream: torch.Tensor, mlp_rows: int) -> torch.Tensor:
        """The previous stage's residual stream [T, H], whose tokens from `mlp_rows` on still lack
        its last layer's MLP -> the stream with every token through that layer."""
        if mlp_rows == stream.shape[0]:
            return stream
        if self.handoff_layer is None:
            raise ValueError(f"{stream.shape[0] - mlp_rows} tokens handed over for the MLP of layer "
                             f"{self.layer_range.start - 1}, which this stage does not hold")
        mlp = getattr(self.model, HANDOFF)[str(self.handoff_layer)]
        stream = stream.clone()
        stream[mlp_rows:] = mlp(stream[mlp_rows:])
        return stream

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Rows to sample from: [N, H] (with their residual) -> logits [N, V] float32."""
        if residual is None:
            hidden = self.model.norm(hidden)
        else:
            hidden, _ = self.model.norm(hidden, residual)
        return self.lm_head(hidden).float()

    def set_backend(self, backend: str) -> None:
        """Which kernels every layer computes with ("torch" | "native" | "triton", kernels.backend);
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
