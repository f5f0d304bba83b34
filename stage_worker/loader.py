"""Loading one stage's (and one tensor rank's) weights from a Hugging Face safetensors checkpoint.

The model is built first, for its layer range and rank; then every parameter it has asks for the
checkpoint tensors it is made of (`CausalLM.checkpoint_sources`). So a stage reads only its layers
(and, with the MLP hand-off, the MLP of the layer before them), opens only the files that hold
them (the index says which; without an index, the files' headers do), and a tensor rank reads only
its slice of each tensor (safetensors `get_slice`).
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moemesh.config import ConfigError, ModelConfig
from moemesh.errors import LoadError
from moemesh.settings import host_memory
from moemesh_kernels.backend import resolve_backend
from stage_worker.layers.linear import load_whole
from stage_worker.layers.parallel import TPGroup
from stage_worker.models import CausalLM, model_class


@dataclass
class LoadStats:
    files_opened: set[str] = field(default_factory=set)
    bytes_read: int = 0
    bytes_by_tensor: dict[str, int] = field(default_factory=dict)

    @property
    def tensors_read(self) -> set[str]:
        return set(self.bytes_by_tensor)


class LazyTensor:
    """A checkpoint tensor not yet read: `.shape`, and indexing reads just the selected part."""

    def __init__(self, name: str, file: str, handle, stats: LoadStats):
        self.name, self.file, self._stats = name, file, stats
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = self._slice.get_dtype()  # safetensors' name: "F32", "BF16", "F8_E4M3", ...

    def __getitem__(self, index) -> torch.Tensor:
        t = self._slice[index]
        n = t.numel() * t.element_size()
        self._stats.bytes_read += n
        self._stats.bytes_by_tensor[self.name] = self._stats.bytes_by_tensor.get(self.name, 0) + n
        return t


class CheckpointReader:
    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.stats = LoadStats()
        self._handles = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = read_index(index)["weight_map"]
        elif (self.dir / "model.safetensors").is_file():  # (transformers reads it alone: a stray file beside it is
            # no part of the model)
            self.weight_map = {name: "model.safetensors" for name in _header_names(self.dir / "model.safetensors")}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise LoadError(f"no *.safetensors files in {self.dir}")
            self.weight_map = {}
            for f in files:
                for name in _header_names(f):
                    if self.weight_map.setdefault(name, f.name) != f.name:
                        raise LoadError(f"tensor {name!r} is in both {self.weight_map[name]} and {f.name} in "
                                        f"{self.dir}, which has no model.safetensors.index.json to say which")

    def get(self, name: str) -> LazyTensor:
        file = self.weight_map.get(name)
        if file is None:
            raise LoadError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise LoadError(f"tensor {name!r} is mapped to {file}, which is missing from {self.dir}")
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as e:  # (safetensors raises its own error type for a bad header or a short file)
                raise LoadError(f"{path} is not a readable safetensors file: {e}") from None
            self.stats.files_opened.add(file)
        try:
            return LazyTensor(name, file, self._handles[file], self.stats)
        except Exception as e:  # the index names a file that does not hold the tensor
            raise LoadError(f"tensor {name!r} is not in {file} ({e})") from None


def read_index(path: Path) -> dict:
    """model.safetensors.index.json: {"weight_map": {tensor name: file}, "metadata": ...}; LoadError naming
    the file when it holds no weight_map."""
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        raise LoadError(f"{path} is not a safetensors index (a JSON object with a weight_map): "
                        f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise LoadError(f"{path}: its weight_map is not an object of tensor names to file names")
    return index


def check_checkpoint(model_dir: str | Path) -> None:
    """LoadError naming the file when a checkpoint's weights cannot be opened (missing, truncated, not
    safetensors): what a launcher checks once before it starts workers that would each fail on it."""
    reader = CheckpointReader(model_dir)
    for file in sorted(set(reader.weight_map.values())):
        path = reader.dir / file
        if not path.is_file():
            raise LoadError(f"{file}, which the checkpoint's index names, is missing from {reader.dir}")
        try:
            safe_open(str(path), framework="pt")
        except Exception as e:  # (safetensors raises its own error type for a bad header or a short file)
            raise LoadError(f"{path} is not a readable safetensors file: {e}") from None


def _header_names(path: Path) -> list[str]:
    """Tensor names from a safetensors header (8-byte length + JSON), without mapping the file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 100 << 20)))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (struct.error, ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        raise LoadError(f"{path} is not a safetensors file: {e}") from None
    return [k for k in header if k != "__metadata__"]


def _check_sizes(reader: CheckpointReader, config: ModelConfig, layers: range | None, tp: TPGroup,
                 dtype: torch.dtype, device: str | torch.device, quant, handoff: bool) -> None:
    """Before any weight is allocated: config.json's layers must be in the checkpoint, and this stage's
    weights, as config.json sizes them, must fit the host. (A size config.json overstates would otherwise
    be an allocator's traceback, or worse a CPU allocation the kernel lets through and a process it kills
    once the weights are read: the same reason allocate_kv checks the KV cache.)"""
    found = {int(m.group(1)) for name in reader.weight_map if (m := _LAYER_NAME.search(name))}
    if found and config.num_layers > max(found) + 1:
        raise LoadError(f"config.json's num_hidden_layers is {config.num_layers}, but the checkpoint in "
                        f"{reader.dir} holds layers 0-{max(found)} only")
    if torch.device(device).type != "cpu":
        return
    with torch.device("meta"), _default_dtype(dtype):
        meta = model_class(config)(config, layers, tp, quant, handoff=handoff)
    nbytes = sum(p.numel() * p.element_size() for p in meta.parameters())  # (the weights, each once)
    memory = host_memory()
    if nbytes > memory:
        stage = f"layers {meta.layer_range.start}-{meta.layer_range.stop - 1}"
        sizes = f"vocab_size {config.vocab_size}, hidden_size {config.hidden_size}, intermediate_size " \
                f"{config.intermediate_size}"
        if config.num_experts:
            sizes += f", {config.num_experts} experts of {config.moe_intermediate_size}"
        # (not --quantization: int8 and fp8 quantize weights loaded at the model's dtype, after loading them)
        halve = ", or load them in bfloat16 (--dtype bfloat16)" if dtype == torch.float32 else ""
        raise LoadError(f"{stage} of {reader.dir} take {nbytes / 2**30:,.1f} GiB of weights as config.json sizes "
                        f"them ({sizes}), more than this host's {memory / 2**30:.1f} GiB: spread "
                        f"the layers over more stages (--pp, --layer-partition) or tensor ranks (--tp){halve}")


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_dir: str | Path, config: ModelConfig | None = None, layers: range | None = None,
               tp: TPGroup = TPGroup(), dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quant=None, progress: bool | None = None, backend: str = "auto",
               handoff: bool = False, max_positions: int | None = None) -> tuple[CausalLM, LoadStats]:
    """Builds the model for `layers` (default: all) on this tensor rank and fills it from the checkpoint.

    progress: None shows a bar only on a terminal. backend: the kernels it computes with
    (moemesh_kernels.backend: auto, torch, native, triton), resolved before the weights are laid out for them.
    handoff: a stage after the first also holds the previous layer's MLP (the MLP hand-off).
    max_positions: the most positions a step can reach (a stage's KV capacity): the rotary tables stop
    there rather than at config.json's max_position_embeddings (which may be 10^7 or more).
    """
    backend = resolve_backend(backend, device)
    config = config or ModelConfig.from_dir(model_dir)
    if config.quantization is not None and quant is None:  # (its codes would load as plain numbers: garbage)
        raise LoadError(f"{model_dir} is a quantized ({config.quantization}) checkpoint: it loads with its "
                        "quantization method (stage_worker.layers.fp8.resolve_quantization)")
    built = config
    if max_positions is not None and max_positions < config.max_position_embeddings:
        built = replace(config, max_position_embeddings=max_positions)  # (the tables' length only)
    reader = CheckpointReader(model_dir)
    _check_sizes(reader, built, layers, tp, dtype, device, quant, handoff)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config)(built, layers, tp, quant, handoff=handoff)
    params = list(model.named_parameters())
    desc = f"loading layers {model.layer_range.start}-{model.layer_range.stop - 1}"
    if tp.size > 1:
        desc += f" (tp rank {tp.rank}/{tp.size})"
    for name, param in tqdm(params, desc=desc, unit="tensor", disable=False if progress else None,
                            leave=False) if progress is not False else params:
        loader = getattr(param, "weight_loader", load_whole)
        for ckpt_name, shard in model.checkpoint_sources(name):
            tensor = reader.get(ckpt_name)
            if tensor.dtype.startswith("F8") and param.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                # (its codes would load as plain numbers: an FP8 checkpoint that quantized what moemesh keeps
                # unquantized, its lm_head or a router gate, without listing it in ignored_layers)
                raise LoadError(f"tensor {ckpt_name!r} in {tensor.file} is stored as {tensor.dtype}, but moemesh "
                                f"loads {name} unquantized (an FP8 checkpoint's lm_head and router gates must "
                                f"be 16/32-bit)")
            if param.dtype == torch.float8_e4m3fn and tensor.dtype != "F8_E4M3":
                # (e5m2 codes or a 16-bit weight would be cast by value: saturated at 448, or scaled twice)
                raise LoadError(f"tensor {ckpt_name!r} in {tensor.file} is stored as {tensor.dtype}, but {name} is "
                                f"an FP8 weight: an FP8 checkpoint's quantized weights must be F8_E4M3")
            try:
                loader(param, tensor, shard)
            except ValueError as e:
                raise LoadError(f"tensor {ckpt_name!r} in {tensor.file}: {e}") from None
    # (the float weights a quantization or the native kernels' packing replaces are freed as they go, not
    # held by this list until the end: a load's peak is one copy of the weights, not two)
    params = param = None
    model.set_backend(backend)
    model.process_weights_after_loading()
    return model.eval(), reader.stats


__all__ = ["CheckpointReader", "ConfigError", "LoadError", "LoadStats", "check_checkpoint", "load_model"]
