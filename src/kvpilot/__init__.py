"""kvpilot: a fast LLM inference server that explains its own speed."""

from kvpilot.omp_pool import prefer_short_omp_spin

prefer_short_omp_spin()  # before torch loads libgomp (omp_pool.py says why; GOMP_SPINCOUNT or OMP_WAIT_POLICY overrides)

from kvpilot.sampling_params import SamplingParams
from kvpilot.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):  # LLM pulls in torch: import it only when asked for
    if name == "LLM":
        from kvpilot.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvpilot' has no attribute {name!r}")
