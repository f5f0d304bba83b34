"""An FP8 copy of a checkpoint, in AutoFP8's layout (what vLLM and moemesh load as quant_method "fp8").

Each Linear weight of the decoder layers (q/k/v/o_proj; the dense MLP's and the shared expert's
gate/up/down_proj; every expert's w1/w2/w3 or gate/up/down_proj) becomes float8_e4m3fn, with a float32
scalar beside it, as AutoFP8 computes them:

    model.layers.0.self_attn.q_proj.weight        float8_e4m3fn  clamp(round(w / scale), -448, 448)
    model.layers.0.self_attn.q_proj.weight_scale  float32 []     scale = amax(|w|) / 448

Everything else is copied as it is: embeddings, norms, biases, lm_head and the router gates
(`mlp.gate`, `block_sparse_moe.gate`, `shared_expert_gate`, which stay exact). config.json gains
`quantization_config` (dynamic activation scales; lm_head and the router gates listed as ignored);
tokenizer files, generation_config.json and the other small files are copied.

Only dynamic activation scales: static ones (`input_scale`) need calibration, running the model on
sample prompts to record each layer's input range, which this does not do.

Shard by shard: each safetensors file is read and written on its own, under the same name, and a
sharded checkpoint's index is rewritten with the scales added.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from moemesh.entrypoints.signals import stop_on_hangup
from moemesh_kernels.fp8 import quantize_fp8
from stage_worker.loader import read_index

INDEX = "model.safetensors.index.json"
# the Linear modules of a decoder layer that are quantized, by their last name component
QUANTIZED_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "w1", "w2", "w3"})
ROUTER_GATES = frozenset({"gate", "shared_expert_gate"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def is_quantized(name: str, tensor_shape) -> bool:
    """Whether checkpoint tensor `name` is one of the Linear weights that become fp8."""
    parts = name.split(".")
    return (name.startswith("model.layers.") and parts[-1] == "weight" and len(tensor_shape) == 2
            and parts[-2] in QUANTIZED_MODULES)


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, activation_scheme: str = "dynamic",
                        progress: bool | None = None) -> Path:
    """Writes the FP8 copy of the checkpoint in `model_dir` to `out_dir` (created if needed); returns it.

    progress: None shows a bar only on a terminal."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if activation_scheme != "dynamic":
        raise ValueError(f"activation_scheme {activation_scheme!r}: only 'dynamic' is supported (static input "
                         "scales need calibration on sample prompts, which quantize_checkpoint does not do)")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized "
                         f"({config['quantization_config'].get('quant_method')!r})")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("out_dir must differ from model_dir")
    if out_dir.is_dir() and any(p.name == INDEX or p.name.endswith(WEIGHT_SUFFIXES) for p in out_dir.iterdir()):
        # (a shard or an index left from another checkpoint would be loaded with this one's config)
        raise ValueError(f"out_dir {out_dir} already holds a checkpoint's weights; give a new or empty directory")

    index_path = model_dir / INDEX
    if index_path.is_file():
        index = read_index(index_path)  # (LoadError, a ValueError, for one that is not an index)
        files = sorted(set(index["weight_map"].values()))
    else:  # (as the loader reads one: model.safetensors alone where it is there)
        index = None
        files = ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else \
            sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    handles = {f: safe_open(str(model_dir / f), framework="pt") for f in files}  # (before anything is made)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.iterdir())
    with stop_on_hangup():  # (SIGTERM, SIGHUP: taken back as after ^C; a second one waits for the cleanup)
        try:
            _write_quantized(model_dir, out_dir, handles, index, config, progress)
        except BaseException:  # (a failure, or ^C, part way: no half-written checkpoint is left to be loaded)
            if created:
                shutil.rmtree(out_dir, ignore_errors=True)
            else:
                for path in set(out_dir.iterdir()) - before:
                    path.unlink(missing_ok=True)
            raise
    return out_dir


def _write_quantized(model_dir: Path, out_dir: Path, handles: dict, index: dict | None, config: dict,
                     progress: bool | None) -> None:
    """quantize_checkpoint's writing, from the checkpoint's open files."""
    weight_map, ignored, total_size, total_params = {}, ["lm_head"], 0, 0
    bar = tqdm(total=sum(len(h.keys()) for h in handles.values()), desc="quantizing to fp8", unit="tensor",
               disable=False if progress else None, leave=False) if progress is not False else None
    for file, handle in handles.items():
        out = {}
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            module = name.rsplit(".", 1)[0]
            if is_quantized(name, tensor.shape):
                out[name], out[f"{module}.weight_scale"] = quantize_fp8(tensor)
            else:
                out[name] = tensor
                if name.startswith("model.layers.") and module.rsplit(".", 1)[-1] in ROUTER_GATES:
                    ignored.append(module)
            if bar is not None:
                bar.update()
        out = {k: v.contiguous() for k, v in out.items()}
        try:
            save_file(out, str(out_dir / file), metadata={"format": "pt"})
        except SafetensorError as e:  # (a write that failed: --out's fault, as an OSError says)
            raise OSError(None, str(e), str(out_dir / file)) from None
        weight_map.update({name: file for name in out})
        total_size += sum(t.numel() * t.element_size() for t in out.values())
        total_params += sum(t.numel() for t in out.values())
    if bar is not None:
        bar.close()

    if index is not None:
        metadata = {**(index.get("metadata") or {}), "total_size": total_size}
        if "total_parameters" in metadata:
            metadata["total_parameters"] = total_params
        _write_json(out_dir / INDEX, {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": list(dict.fromkeys(ignored))}
    _write_json(out_dir / "config.json", config)
    for path in model_dir.iterdir():  # tokenizer, generation config, chat template, README, ...
        if path.is_file() and path.name not in ("config.json", INDEX) and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


__all__ = ["is_quantized", "quantize_checkpoint"]
