"""specengine: lossless, low-latency LLM generation with speculative decoding."""
from .api import Engine, GenerationResult
from .errors import SpecEngineError
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SpecEngineError"]
__version__ = "0.1.0"
