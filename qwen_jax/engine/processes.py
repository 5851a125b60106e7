"""The engine's processes: the names they carry in `ps -e`, `top` and `pgrep` (the kernel's 15-character process
name), so an engine core or a compile worker can be told apart from other Python processes, and the JAX settings a
process it starts takes over."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

CORE = "qwen-jax-core"
COMPILE_WORKER = "qwen-jax-compile"[:15]  # the kernel keeps 15 characters
_PR_SET_NAME = 15  # prctl(2)
# JAX settings an engine core or compile worker takes over from the process that starts it (the persistent
# compilation cache).
INHERITED_CONFIG = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                    "jax_persistent_cache_min_entry_size_bytes")


def set_process_name(name: str) -> None:
    """Name this process (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
