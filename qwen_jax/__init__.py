"""qwen-jax: a JAX/XLA inference engine for the Qwen3.5 family and LLaMA-like decoders."""
