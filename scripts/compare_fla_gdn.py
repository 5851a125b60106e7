"""GDN chunked prefill: our gdn_prefill against flash-linear-attention's chunk_gated_delta_rule (the Triton kernels
vLLM and SGLang run for Qwen3-Next / Qwen3.5 prefill) on the same inputs: GPU kernel time of each and how far apart
their outputs and final states are. Prints one JSON line per case.

Needs a GPU, torch with CUDA and fla-core (`pip install fla-core einops`; neither is a dependency of qwen-jax).
Ours is timed first for every case: the JAX profiler and torch's both use CUPTI, and once torch's has run in a
process the JAX one cannot start again.

    python scripts/compare_fla_gdn.py
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pallas_kernels import gdn
from qwen_jax.bench import kernels as bench

CASES = ((1, 2048), (1, 4096), (8, 1024), (64, 1024))  # (prompts, tokens each), 35B-A3B shapes (bench.GP_FULL)


def ours(cases: tuple) -> dict:
    import jax

    run = jax.jit(gdn.delta_rule)
    result = {}
    for rows, seq in cases:
        inputs = bench.gdn_prefill_inputs(rows, seq, False, bench.GP_FULL)
        args = tuple(inputs.values())
        out, ssm = map(np.asarray, run(*args))
        slots = np.asarray(inputs["batch"].state_slot)  # the prompts' slots, in order
        result[(rows, seq)] = dict(us=bench.gpu_us(lambda args=args: run(*args)),
                                   out=out.reshape(rows, seq, *out.shape[1:]), state=ssm[slots])
    return result


def fla(rows: int, seq: int) -> dict:
    """fla's chunk_gated_delta_rule on bench.gdn_prefill_inputs(rows, seq): gates and beta formed as the model
    does (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), q/k L2-normed in the kernel, prompts packed
    with cu_seqlens (as on our token axis), each from its slot's state. GPU time: torch's profiler, the kernels of
    5 calls summed, divided by 5."""
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from torch.profiler import ProfilerActivity, profile

    dims = bench.GP_FULL
    inputs = bench.gdn_prefill_inputs(rows, seq, False, dims)
    tokens, nk, nv, dk, dv = rows * seq, dims["nk"], dims["nv"], dims["dk"], dims["dv"]
    cuda = lambda x, dtype=torch.bfloat16: torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dtype)  # noqa: E731
    q, k = (cuda(inputs[name]).reshape(1, tokens, nk, dk) for name in ("q", "k"))
    v = cuda(inputs["v"]).reshape(1, tokens, nv, dv)
    a, b = (cuda(inputs[name], torch.float32).reshape(1, tokens, nv) for name in ("a", "b"))
    g = -torch.exp(cuda(inputs["A_log"], torch.float32)) * F.softplus(a + cuda(inputs["dt_bias"], torch.float32))
    beta = torch.sigmoid(b).to(torch.bfloat16)
    state = cuda(inputs["ssm"][inputs["batch"].state_slot], torch.float32)
    cu_seqlens = torch.arange(0, rows + 1, device="cuda", dtype=torch.long) * seq if rows > 1 else None

    def call():
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)

    for _ in range(3):  # the first call autotunes
        out, final = call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] = kernels.get(event.name[:60], 0.0) + event.device_time / 5
    return dict(us=sum(kernels.values()), kernels=kernels, out=out.float().cpu().numpy().reshape(rows, seq, nv, dv),
                state=final.float().cpu().numpy())


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    mine = ours(CASES)
    rel = lambda x, y: float(np.max(np.abs(x - y)) / np.max(np.abs(y)))  # noqa: E731
    for rows, seq in CASES:
        theirs, ours_case = fla(rows, seq), mine[(rows, seq)]
        print(json.dumps(dict(
            case=f"{rows} x {seq}", ours_gpu_us=round(ours_case["us"], 1), fla_gpu_us=round(theirs["us"], 1),
            rel_diff_out=round(rel(ours_case["out"], theirs["out"]), 4),
            rel_diff_state=round(rel(ours_case["state"], theirs["state"]), 4),
            fla_kernels={name: round(us, 1) for name, us in sorted(theirs["kernels"].items(), key=lambda kv: -kv[1])
                         if us >= 1.0})), flush=True)


if __name__ == "__main__":
    main()
