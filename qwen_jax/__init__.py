"""qwen-jax: a JAX/XLA inference engine for the Qwen3.5 family and LLaMA-like decoders.

Importing it never allocates device memory (JAX is told not to preallocate, so other processes can share the GPU)
and never imports the engine: the public names load on first use, so a low module (the config, a layer) imports
alone, without the package pulling in everything above it. JAX's allocator may grow to 99% of the device (its
default cap is 75%); the engine argument `gpu_memory_utilization` is the share of the device the engine takes.
"""

import importlib
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Under JAX's default cap of 75% an H200 holding 35B-A3B's 66 GiB of weights has room for only ~370k KV tokens, and
# an H100 80 GB none; the engine's own budget (gpu_memory_utilization, a share of the device) is the real limit.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.99")

# The public API, by name -> the module that defines it. The server (and any other user) imports these only.
_PUBLIC = {
    "LLM": "qwen_jax.llm", "AsyncLLM": "qwen_jax.llm", "EngineDead": "qwen_jax.llm",
    "SamplingParams": "qwen_jax.sampling_params", "StructuredOutputsParams": "qwen_jax.sampling_params",
    "RequestOutput": "qwen_jax.outputs", "RequestFailed": "qwen_jax.outputs", "TokenLogprob": "qwen_jax.outputs",
    "create_engine": "qwen_jax.engine.eval_adapter",
    "ENGINE_ARGS": "qwen_jax.engine.core", "LOAD_FORMATS": "qwen_jax.engine.core", "EngineCore": "qwen_jax.engine.core",
    "ModelNotFound": "qwen_jax.engine.model_files", "resolve_path": "qwen_jax.engine.model_files",
    "read_model_config": "qwen_jax.engine.model_files", "sampling_defaults": "qwen_jax.engine.model_files",
    "check_structured_outputs": "qwen_jax.engine.grammar", "parse_speculative_config": "qwen_jax.engine.speculative",
    "default_cache_dir": "qwen_jax.default_model", "ensure_default_model": "qwen_jax.default_model",
    "host_settings": "sharding.distributed", "parse_layout": "sharding.devices",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'qwen_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
