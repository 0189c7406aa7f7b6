"""SwiftSpec: a local LLM chat engine with asynchronous, disaggregated speculative decoding.

The public API is imported lazily so that ``swiftspec --help`` does not pay for importing torch.
"""

from swiftspec.engine.config import EngineConfig, SamplingParams, TreeParams
from swiftspec.engine.events import StepEvent, StepStats

__all__ = ["Engine", "EngineConfig", "EngineError", "SamplingParams", "StepEvent", "StepStats", "TreeParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Engine", "EngineError"):
        from swiftspec.engine.host import client  # the Engine's modules only once it is asked for

        return getattr(client, name)
    raise AttributeError(name)
