"""qwen-jax: a JAX/XLA inference engine for the Qwen3.5 family and LLaMA-like decoders.

Importing it never allocates device memory: JAX is told not to preallocate, so other processes can share the GPU.
JAX's allocator may grow to 95% of the device (its default cap is 75%); `gpu_memory_utilization` sizes the caches.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Under JAX's default cap of 75% an H200 holding 35B-A3B's 65 GiB of weights has room for only ~370k KV tokens,
# fewer than 256 sequences of 2k tokens need; the engine's own budget (gpu_memory_utilization) is the real limit.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from qwen_jax.engine.skeleton import create_engine  # noqa: E402
from qwen_jax.llm import LLM, AsyncLLM  # noqa: E402
from qwen_jax.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "create_engine"]
