"""How the kernels here size and launch their calls: tile sizes that divide a dimension, how far a weight-streaming
kernel splits its contraction, a Pallas call's interpret / Triton options, and whether native Triton kernels
(jax-triton) can launch on this machine.

Shared by several kernels, so none imports another's helpers; it must never choose between a kernel and its jnp
reference (qwen_jax/layers/hot_ops.py does).
"""

from __future__ import annotations

import importlib.util

import jax


def tile_size(dim: int, preferred: int) -> int:
    """The largest power of two <= preferred that divides dim (at least 16: Triton's smallest dot tile)."""
    size = preferred
    while size > 16 and dim % size:
        size //= 2
    if dim % size:
        raise ValueError(f"dimension {dim} is not a multiple of 16 (the smallest tile)")
    return size


MIN_PROGRAMS = 256  # weight-streaming kernels split their contraction until this many programs run


def split_contraction(programs: int, steps: int, split_k: int | None = None, want: int = MIN_PROGRAMS) -> int:
    """How many slices a weight-streaming kernel of `programs` programs splits its contraction (`steps` steps of
    block_k) into: `split_k` when given (checked to cut no step), else the fewest powers of two that give `want`
    programs, each slice a whole number of steps. At one token (8 pairs x 8 column blocks = 64 programs) too few
    programs run to stream the weights at full bandwidth (132 SMs on an H200)."""
    if split_k is not None:
        if split_k < 1 or steps % split_k:
            raise ValueError(f"split_k {split_k} does not divide the {steps} steps of the contraction")
        return split_k
    split = 1
    while programs * split < want and steps % (2 * split) == 0:
        split *= 2
    return split


def triton_available() -> bool:
    """Whether native Triton kernels can launch here: a GPU backend and jax-triton installed (the cuda extra)."""
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


def pallas_backend(interpret: bool | None, num_warps: int, num_stages: int) -> dict:
    """pallas_call's interpret and compiler_params: interpret on CPU unless told; Triton's launch options else."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return dict(interpret=True, compiler_params=None)
    from jax.experimental.pallas import triton as pltriton  # GPU only; Mosaic GPU is the default otherwise

    return dict(interpret=False, compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages))
