"""Model classes by Hugging Face `model_type`."""

from moemesh.config import ModelConfig
from stage_worker.models.base import CausalLM
from stage_worker.models.llama import LlamaForCausalLM
from stage_worker.models.mixtral import MixtralForCausalLM
from stage_worker.models.qwen2_moe import Qwen2MoeForCausalLM
from stage_worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    return MODELS[config.model_type]  # ModelConfig already refused unsupported architectures
