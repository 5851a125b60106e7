"""Pure-jnp math of every layer: the reference that kernels in pallas_kernels/ must match."""
