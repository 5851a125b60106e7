"""Where a step program's lowering goes (a compile worker's "lowered in"): lower the named programs of a
35B-A3B-shaped runner (abstract weights, nothing allocated) one after another in this process, each timed, the first
under cProfile (its top functions by cumulative time printed); with --compile, each also compiled and timed.

    python scripts/lowering_profile.py <config dir> <kernels> "forward[1]" "forward[64]" ...
"""

import cProfile
import pstats
import sys
import time

from qwen_jax.config import load_config
from qwen_jax.engine.programs import ProgramTable, Shapes
from sharding.mesh import make_mesh


def main() -> None:
    compile_too = "--compile" in sys.argv
    config, kernels, *names = [a for a in sys.argv[1:] if a != "--compile"]
    cfg = load_config(config)
    mesh = make_mesh(1)
    shapes = Shapes(cfg=cfg, kernels=kernels, tensor_parallel_size=1, enable_expert_parallel=False, num_blocks=4096,
                    block_size=16, num_slots=65, num_snapshots=8, max_model_len=4096, max_num_seqs=64,
                    max_num_batched_tokens=8192, decode_steps=4, decode_steps_max_rows=8, num_speculative_tokens=1,
                    drafts_at=(1,) * 64)
    table = ProgramTable(shapes, mesh)
    jobs = {key.name: key for key in shapes.catalog(shapes.token_buckets)}
    for i, name in enumerate(names):
        profile = cProfile.Profile() if i == 0 else None
        began = time.perf_counter()
        if profile:
            profile.enable()
        lowered = table.lower(jobs[name])
        if profile:
            profile.disable()
        print(f"{name}: lowered in {time.perf_counter() - began:.2f}s", flush=True)
        if profile:
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        if compile_too:
            began = time.perf_counter()
            lowered.compile()
            print(f"{name}: compiled in {time.perf_counter() - began:.2f}s", flush=True)


if __name__ == "__main__":
    main()
