"""hybrid-engine: a serving engine for hybrid Mamba-2 / attention / MoE language models."""
__version__ = "0.1.0"  # the package's version (pyproject.toml reads it)

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.llm import LLM
from hybrid_engine.request import CompletionOutput, RequestOutput
from hybrid_engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["__version__", "LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
