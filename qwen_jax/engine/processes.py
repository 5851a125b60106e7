"""The names this engine's processes carry in `ps -e`, `top` and `pgrep` (the kernel's 15-character process name),
so an engine core or a compile worker can be told apart from other Python processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

CORE = "qwen-jax-core"
COMPILE_WORKER = "qwen-jax-compile"[:15]  # the kernel keeps 15 characters
_PR_SET_NAME = 15  # prctl(2)


def set_process_name(name: str) -> None:
    """Name this process (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
