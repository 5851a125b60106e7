"""qwen-jax: a JAX/XLA inference engine for the Qwen3.5 family and LLaMA-like decoders.

Importing it never allocates device memory: JAX is told not to preallocate, so other processes can share the GPU.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from qwen_jax.engine.skeleton import create_engine  # noqa: E402
from qwen_jax.llm import LLM, AsyncLLM  # noqa: E402
from qwen_jax.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "create_engine"]
