"""Session-wide settings for the CPU test suite."""

import os

# Triton kernels (pallas_kernels/moe_triton.py) run in Triton's interpreter here. triton.jit reads this when it
# decorates, including Triton's own library functions when triton is first imported: set before any test module
# (or library it loads) imports triton, or interpreted kernels fail calling compiled-mode helpers.
os.environ.setdefault("TRITON_INTERPRET", "1")
