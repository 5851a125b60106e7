"""Multi-host start-up: join this process to the others (jax.distributed) so jax.devices() and the mesh span all
hosts; every host then runs the same program on its own devices.

Call `initialize` once per process, before any other JAX call; it never builds meshes or touches weights.
"""

from __future__ import annotations

import os

import jax

# Read when an argument is not given: JAX's own names first, then torchrun-style ones.
ENV_COORDINATOR = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
ENV_NUM_HOSTS = ("JAX_NUM_PROCESSES", "NUM_HOSTS", "WORLD_SIZE")
ENV_HOST_INDEX = ("JAX_PROCESS_ID", "HOST_INDEX", "RANK")


def _env(names: tuple[str, ...]) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def host_settings(num_hosts: int | None = None, host_index: int | None = None, coordinator_address: str | None = None
             ) -> tuple[int, int, str | None]:
    """(num_hosts, host_index, coordinator_address): the arguments given, the environment for the others (torchrun's
    MASTER_ADDR/MASTER_PORT also give the coordinator); one host, index 0, no address by default."""
    num_hosts = int(num_hosts if num_hosts is not None else _env(ENV_NUM_HOSTS) or 1)
    host_index = int(host_index if host_index is not None else _env(ENV_HOST_INDEX) or 0)
    address = coordinator_address or _env(ENV_COORDINATOR)
    if address is None and os.environ.get("MASTER_ADDR"):
        address = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '1234')}"
    return num_hosts, host_index, address


def initialize(num_hosts: int | None = None, host_index: int | None = None, coordinator_address: str | None = None,
               local_device_ids: list[int] | None = None, cpu_collectives: str | None = "gloo",
               timeout_s: int = 300) -> bool:
    """Join the cluster of `num_hosts` processes (host 0 serves `coordinator_address`, "host:port"); arguments not
    given come from the environment (`host_settings`). Returns False (and does nothing) for a single host. On CPU,
    cross-process collectives need `cpu_collectives` (gloo)."""
    num_hosts, host_index, address = host_settings(num_hosts, host_index, coordinator_address)
    if num_hosts <= 1:
        return False
    if jax.distributed.is_initialized():  # a second engine in the same process
        return True
    if address is None:
        raise ValueError("multi-host start needs a coordinator address (argument or JAX_COORDINATOR_ADDRESS)")
    if not 0 <= host_index < num_hosts:
        raise ValueError(f"host_index {host_index} is outside 0..{num_hosts - 1}")
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    # JAX's preemption service (for training checkpoints) catches SIGTERM; a server must receive it to drain and stop.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator_address=address, num_processes=num_hosts, process_id=host_index,
                               local_device_ids=local_device_ids, initialization_timeout=timeout_s)
    return True


def shutdown() -> None:
    jax.distributed.shutdown()
