"""Process helpers of the multi-host tests: a free coordinator port and the environment of one CPU host process."""

from __future__ import annotations

import os
import socket

from sharding_flags import FAST_COMPILE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_env(devices: int) -> dict:
    """os.environ for a child process with `devices` fake CPU devices that imports the repo and these helpers; the
    parent's other XLA flags stay."""
    inherited = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
                 if not flag.startswith("--xla_force_host_platform_device_count")]
    flags = " ".join([*inherited, f"--xla_force_host_platform_device_count={devices}"]
                     + ([FAST_COMPILE] if "xla_backend_optimization_level" not in " ".join(inherited) else []))
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
