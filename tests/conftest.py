"""Session-wide settings for the CPU test suite."""

import os

# Triton kernels (pallas_kernels/moe_triton.py) run in Triton's interpreter here. triton.jit reads this when it
# decorates, including Triton's own library functions when triton is first imported: set before any test module
# (or library it loads) imports triton, or interpreted kernels fail calling compiled-mode helpers.
os.environ.setdefault("TRITON_INTERPRET", "1")

# XLA:CPU's concurrency-optimized HLO scheduler off. With it, the sharding tests (8 fake devices sharing 2 cores)
# deadlocked in collectives once the GDN conv became one window per tap: three test files in one process hung idle at
# the same test, and the suite aborted twice (pallas_kernels/BENCH_H200.md, twelfth session); with it off they pass.
# Read when jax starts its CPU backend, so set here, before any test module imports jax. CPU only; GPUs ignore it.
SEQUENTIAL_CPU_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SEQUENTIAL_CPU_SCHEDULE}".strip()
