"""kernels="auto", the default: the GPU kernels on a GPU backend, the jnp references elsewhere, said at start-up."""

import logging

from qwen_jax import LLM
from qwen_jax.layers.hot_ops import resolve_kernels


def test_auto_takes_the_references_on_the_cpu_and_says_so(caplog):
    assert resolve_kernels("auto") == "reference"  # the suite runs on the CPU
    assert (resolve_kernels("gpu"), resolve_kernels("reference")) == ("gpu", "reference")
    with caplog.at_level(logging.INFO, logger="qwen_jax"):
        llm = LLM(None, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, dtype="float32")
    assert llm.engine.args["kernels"] == "reference"
    assert "hot ops: the jnp references (kernels=auto)" in caplog.text
