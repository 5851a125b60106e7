"""qwen_jax.bench.kernels --small: every kernel's table on tiny shapes, interpreted on the CPU, without a failure.
The bench is how the kernels' GPU numbers are taken; a call in it that falls behind a kernel's signature would
otherwise only show on the device (as ecf7108's change of a launch's arguments did)."""

from qwen_jax.bench import kernels as bench


def test_small_bench_runs_every_kernel_and_reports_no_failure(capsys):
    assert bench.main(["--small", "--defaults-only"]) == 0
    out = capsys.readouterr().out
    for kernel in ("moe_gemm", "gdn_decode", "paged_attention", "gdn_prefill", "skinny_matmul", "router"):
        assert f"### {kernel} on" in out, kernel
    for launch in ("gdn_prefill_prepare", "gdn_prefill_recurrence"):
        assert f"{launch} alone" in out, launch  # each launch timed alone, with the arguments the kernels take now
    # --defaults-only: each kernel's default tiles, no sweep rows
    assert "| default: pallas moe_gemm" in out and "| pallas moe_gemm" not in out
    assert "| pallas paged_attention | defaults |" in out and "| pallas paged_attention | BM=" not in out
