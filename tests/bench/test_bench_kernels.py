"""qwen_jax.bench.kernels --small: every kernel's table on tiny shapes, interpreted on the CPU, without a failure, and
the one-page table it writes (pallas_kernels/BENCH_H200.md's format). The bench is how the kernels' GPU numbers are
taken; a call in it that falls behind a kernel's signature would otherwise only show on the device (as ecf7108's
change of a launch's arguments did)."""

from qwen_jax.bench import kernels as bench


def test_small_bench_runs_every_kernel_and_reports_no_failure(capsys, tmp_path):
    page = tmp_path / "BENCH.md"
    assert bench.main(["--small", "--defaults-only", "--write", str(page)]) == 0
    out = capsys.readouterr().out
    for kernel in ("moe_gemm", "gdn_decode", "paged_attention", "gdn_prefill", "skinny_matmul", "router"):
        assert f"### {kernel} on" in out, kernel
    for launch in ("gdn_prefill_prepare", "gdn_prefill_recurrence"):
        assert f"{launch} alone" in out, launch  # each launch timed alone, with the arguments the kernels take now
    # --defaults-only: each kernel's default tiles, no sweep rows
    assert "| default: pallas moe_gemm" in out and "| pallas moe_gemm" not in out
    assert "| pallas paged_attention | defaults |" in out and "| pallas paged_attention | BM=" not in out
    # one row a kernel and shape (--small: 2 shapes each; skinny_matmul 3 weight sets x 2 row counts)
    text = page.read_text()
    assert "`python -m qwen_jax.bench.kernels --small --defaults-only --write " in text
    rows = [line.split(" | ")[0].lstrip("| ") for line in text.splitlines() if line.startswith("| ")][1:]
    assert {kernel: rows.count(kernel) for kernel in dict.fromkeys(rows)} == {
        "moe_gemm, few-token": 2, "gdn (decode)": 2, "paged_attention": 2, "gdn (prefill)": 2, "skinny_matmul": 6,
        "router": 2}


def test_summary_rows_hold_the_time_against_the_bound_its_bytes_or_flops_set():
    h200_bytes, h200_flops = 4.8e12 * 100e-6, 989e12 * 100e-6  # what 100 us moves or computes at the peaks
    rows = [bench.Summary("memory", "a", 100.0, 200.0, 400.0, moved=h200_bytes / 2, flops=h200_flops / 10),
            bench.Summary("compute", "b", 100.0, 100.0, 50.0, moved=h200_bytes / 10, flops=h200_flops / 4),
            bench.Summary("launches", "c", 2.0, 2.0, 7.0),
            bench.Summary("no reference", "d", 10.0, 10.0, float("nan"), moved=h200_bytes)]
    lines = bench.summary_table(rows, "NVIDIA H200").splitlines()[2:]
    assert lines == ["| memory | a | 100.0 | 2.40 TB/s | 50% | 200.0 | 400.0 | 2.00x |",
                     "| compute | b | 100.0 | 247.2 TFLOP/s | 25% | 100.0 | 50.0 | 0.50x |",
                     "| launches | c | 2.0 | - | - | 2.0 | 7.0 | 3.50x |",
                     "| no reference | d | 10.0 | 48.00 TB/s | 1000% | 10.0 | - | - |"]
