"""RESULTS.json at the repository root: one entry appended per benchmark run, with where and how it ran.

Only the benchmarks write it; never edit it by hand, and never rewrite or drop earlier entries.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_RESULTS = os.path.join(REPO_ROOT, "RESULTS.json")


def git_commit(repo: str = REPO_ROOT) -> str | None:
    """$QWEN_JAX_COMMIT when set: the commit a copied tree was made from (the device tool's copy carries stale git
    metadata, so its own HEAD would be wrong). Else `git rev-parse HEAD`, with `+dirty` when tracked files differ;
    None outside git."""
    if os.environ.get("QWEN_JAX_COMMIT"):
        return os.environ["QWEN_JAX_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def portable_command(argv: Sequence[str]) -> list[str]:
    """argv without this machine's paths: an absolute path (alone or after `--flag=`) inside the repository becomes
    relative to it, any other becomes its file name, so an entry reads the same wherever it ran."""

    def portable(arg: str) -> str:
        flag, eq, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if not os.path.isabs(value):
            return arg
        inside = os.path.commonpath([REPO_ROOT, os.path.abspath(value)]) == REPO_ROOT
        return flag + eq + (os.path.relpath(value, REPO_ROOT) if inside else os.path.basename(value))

    return [portable(arg) for arg in argv]


def make_entry(benchmark: str, *, device: str | None, device_count: int | None, layout: str | None,
               model: str | None, weights: str | None, config: str | None, levels: Any = None,
               score: float | None = None, roofline: Any = None, argv: Sequence[str] | None = None,
               **extra: Any) -> dict:
    """A RESULTS.json entry. `weights` is "real" or "random"; `layout` names the parallelism, e.g. "TP=2,EP=1,DP=1";
    `levels` holds the per-level (or per-batch) numbers and `roofline` the measured/roofline ratios."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join(portable_command(argv if argv is not None else
                                               [os.path.basename(sys.executable), *sys.argv])),
        "device": device,
        "device_count": device_count,
        "layout": layout,
        "model": model,
        "weights": weights,
        "config": config,
        "levels": levels,
        "weighted_score": score,
        "roofline": roofline,
        **extra,
    }


def append_result(entry: dict, path: str = DEFAULT_RESULTS) -> None:
    """Append `entry` to the JSON list at `path` (created when missing); written to a temporary file first so
    an interrupted run never leaves a truncated file. The repository's RESULTS.json takes clean entries only: an
    entry of no commit or of a tree with uncommitted changes is refused there (a ValueError) and may go elsewhere."""
    commit = entry.get("commit")
    if os.path.abspath(path) == DEFAULT_RESULTS and (not commit or commit.endswith("+dirty")):
        raise ValueError(f"not appending to {path}: the run's commit is {commit!r}; commit first (or set "
                         f"QWEN_JAX_COMMIT to the commit a copied tree was made from), or pass another results path")
    runs: list = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
        if not isinstance(runs, list):
            raise ValueError(f"{path} does not hold a JSON list of runs")
    runs.append(entry)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(runs, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
