"""Fixtures of the sharding tests: one tiny model of each architecture family.

Tests here need 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as scripts/test.sh sets)."""

from __future__ import annotations

import gc
import os

from sharding_flags import FAST_COMPILE

# Before jax starts a backend: 8 host devices, and LLVM at -O0 (sharding_flags says why).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE

import jax  # noqa: E402
import pytest  # noqa: E402
from sharding_tiny_models import TINY_CONFIGS  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_compilation_cache():
    """The server tests (which run first) turn JAX's persistent compilation cache on for the rest of the process;
    these tests compile many 8-device programs they never reuse, and writing one of them (interpreted Pallas
    kernels) once crashed the process inside the cache's serializer. Off here, back on afterwards."""
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()
    jax.clear_caches()  # each module's many 8-device programs are never run again: free them before the next
    gc.collect()


@pytest.fixture(autouse=True)
def _eight_devices() -> None:
    assert jax.device_count() >= 8, "tests/sharding need XLA_FLAGS=--xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_name(request) -> str:
    return request.param
