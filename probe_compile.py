"""Probe (not committed): lower vs compile time of a few step programs, and persistent-cache hits across processes."""
import logging, os, sys, time
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("jax._src.cache_key").setLevel(logging.DEBUG)
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
from qwen_jax.config import load_config
from qwen_jax.engine import step
from qwen_jax.engine.core import engine_args
from qwen_jax.engine.replica import Replica
from qwen_jax.weights import dummy_params
from sharding import rules
from sharding.mesh import make_mesh
cfg = load_config(".devdata/Qwen3.5-35B-A3B/config.json")
mesh = make_mesh(1)
t = time.perf_counter()
params = dummy_params(cfg, seed=0, shardings=rules.param_shardings(cfg, mesh))
jax.block_until_ready(params)
print("params", round(time.perf_counter() - t, 1), flush=True)
args = engine_args(dict(max_num_seqs=64, max_num_batched_tokens=8192, block_size=16, num_kv_blocks=4096, kernels="gpu"))
r = Replica(0, cfg, params, mesh, args, 8192, [], seed=0).runner
c = r.compiler
for size in (1, 2048):
    layout = c.step_inputs(size)[1]
    t = time.perf_counter()
    lowered = step.forward.lower(c.abstract(r.params), c.abstract(r.cache), c.abstract(r.last_tokens), c.packed(layout.size),
                                 layout=layout, cfg=r.cfg, mesh=r.mesh, kernels=r.kernels, with_hidden=True)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    print(f"PROBE forward[{size}] lower {t1 - t:.1f}s compile {t2 - t1:.1f}s", flush=True)
t = time.perf_counter(); c._drafter(1); print(f"PROBE draft[1] lower+compile {time.perf_counter() - t:.1f}s", flush=True)
lay = c.padding_sampling(64)[1]
t = time.perf_counter(); c._sampler(lay, 2, 0, False); print(f"PROBE sampler[64,path2] {time.perf_counter() - t:.1f}s", flush=True)
