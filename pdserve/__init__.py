"""pdserve: disaggregated prefill/decode LLM serving.

from pdserve import LLM, SamplingParams
"""

from engine.llm import LLM, CompletionOutput, RequestOutput
from scheduler.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
