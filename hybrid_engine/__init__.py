"""hybrid-engine: a serving engine for hybrid Mamba-2 / attention / MoE language models."""
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.llm import LLM
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
