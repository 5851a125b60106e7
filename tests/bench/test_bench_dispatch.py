"""qwen_jax.bench.dispatch on a tiny hybrid MoE model on the CPU: every row of its table of host costs (the forward
compiled ahead and jitted, issued one ahead) is measured and printed. Its numbers only mean something on a GPU."""

from __future__ import annotations

import json

from qwen_jax.bench import dispatch
from qwen_jax.default_model import TEXT_CONFIG


def test_dispatch_prints_every_host_cost(tmp_path, capsys):
    config = dict(TEXT_CONFIG, vocab_size=300, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    dispatch.main(["--config", str(tmp_path / "config.json"), "--kernels", "reference", "--steps", "2",
                   "--max-num-seqs", "2"])
    rows = dict(line.strip("|").rsplit("|", 1) for line in capsys.readouterr().out.splitlines()
                if line.startswith("| ") and "host us" not in line)
    rows = {name.strip(): float(us) for name, us in rows.items()}
    for label in ("compiled", "jit"):
        for part in ("transfer of the step's inputs", "forward call (1 token)", "sampler call",
                     "whole step, issued one ahead"):
            assert rows[f"{label}: {part}"] > 0
    assert rows["jit call, params + cache only (no work)"] > 0 and rows["forward call and wait (1 token)"] > 0
