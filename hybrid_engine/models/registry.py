"""Architecture name -> model class."""
from hybrid_engine.models.base import HybridForCausalLM
from hybrid_engine.models.config import GRANITE_MOE_HYBRID, NEMOTRON_H, HybridConfig
from hybrid_engine.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from hybrid_engine.models.nemotron_h import NemotronHForCausalLM
from layers.kernels.ops import KernelOps
from layers.parallel import SINGLE, ParallelContext

MODEL_CLASSES: dict[str, type[HybridForCausalLM]] = {
    NEMOTRON_H: NemotronHForCausalLM,
    GRANITE_MOE_HYBRID: GraniteMoeHybridForCausalLM,
}


def build_model(config: HybridConfig, *, ops: KernelOps, tp: ParallelContext = SINGLE) -> HybridForCausalLM:
    """Instantiate the model class for `config.architecture` running `ops`, holding rank
    `tp.rank`'s share of it (weights uninitialized)."""
    return MODEL_CLASSES[config.architecture](config, ops=ops, tp=tp)
