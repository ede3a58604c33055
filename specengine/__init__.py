"""specengine: lossless, low-latency LLM generation with speculative decoding."""
from .api import Engine, GenerationResult
from .config import EngineConfig
from .errors import SpecEngineError
from .methods.sampling import SamplingParams
from .request import RequestParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "RequestParams", "SamplingParams", "SpecEngineError"]
__version__ = "0.1.0"
