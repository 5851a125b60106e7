"""The GPUs this host shows, found without starting JAX, and the environment that makes a replica's process see
only its own devices (data-parallel replicas as processes), and the layout a server takes when none is given.

It never initialises a JAX backend: a front that did would hold a CUDA context (and memory) on every GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (its entries when it is set), or []
    when there are none or JAX is told to use the CPU ($JAX_PLATFORMS)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(re.findall(r"^GPU \d+:", out, re.M))]


def cpu_device_count() -> int:
    """Host-platform devices JAX makes on the CPU ($XLA_FLAGS' --xla_force_host_platform_device_count, else 1)."""
    found = re.search(DEVICE_COUNT_FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


def replica_environments(data_parallel_size: int, tensor_parallel_size: int | None) -> list[dict[str, str]]:
    """The environment of each of `data_parallel_size` replica processes: replica i sees devices [i*tp, (i+1)*tp)
    of this host's, as its devices 0..tp-1 (CUDA_VISIBLE_DEVICES on GPUs; on the CPU, tp host-platform devices).
    tensor_parallel_size None: this host's devices split evenly. Every replica then compiles the same programs
    (a compiled program is bound to its device numbers), so they share one persistent compilation cache."""
    dp = int(data_parallel_size)
    gpus = visible_gpus()
    count = len(gpus) or cpu_device_count()
    tp = int(tensor_parallel_size) if tensor_parallel_size else max(1, count // dp)
    if dp * tp > count:
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs more than the {count} devices "
                         f"of this host")
    if gpus:
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])} for i in range(dp)]
    flags = re.sub(DEVICE_COUNT_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return [{"XLA_FLAGS": f"{flags} {DEVICE_COUNT_FLAG}={tp}".strip()} for _ in range(dp)]


# The layout a server takes on the GPUs of one host when no layout flag is given (`--layout auto`): for each GPU
# count, (data-parallel replicas, tensor-parallel size, experts split over the tensor-parallel devices). Data
# parallelism (one replica process a GPU) for a model one GPU holds: no collective in a step, and each replica's host
# thread its own. Not yet compared with TP/EP layouts by the judge's procedure on several GPUs
# (scripts/judge_sweep.sh; sharding/README.md). A model whose weights do not fit one GPU's share
# (AUTO_WEIGHT_SHARE) is split over the fewest GPUs that hold it.
AUTO_LAYOUTS = {1: (1, 1, False), 2: (2, 1, False), 4: (4, 1, False), 8: (8, 1, False)}
AUTO_WEIGHT_SHARE = 0.6


def parse_layout(text: str) -> tuple[int, int, bool]:
    """'DP=2,TP=2' / 'TP=4,EP' / 'EP=4' (case-insensitive; EP=N is TP=N with the experts split) -> (dp, tp, ep)."""
    dp, tp, ep = 1, 1, False
    for part in filter(None, (p.strip().upper() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("DP", "TP", "EP") or (value and not value.isdigit()) or (name != "EP" and not value):
            raise ValueError(f"layout {text!r}: expected parts like DP=2, TP=2, EP or EP=2")
        if name == "DP":
            dp = int(value)
        elif name == "TP":
            tp = int(value)
        else:
            ep = True
            tp = int(value) if value else tp
    if dp < 1 or tp < 1:
        raise ValueError(f"layout {text!r}: sizes must be at least 1")
    return dp, tp, ep


def auto_layout(num_gpus: int, weight_bytes: int, gpu_bytes: int | None) -> tuple[int, int, bool]:
    """(dp, tp, ep) for `num_gpus` GPUs of one host: AUTO_LAYOUTS when one GPU holds the weights (`gpu_bytes` None:
    not known, assumed so), else the fewest GPUs (a power of two) that hold them as tensor-parallel groups with the
    experts split, as many replicas as fit."""
    if num_gpus < 1:
        return 1, 1, False
    tp = 1
    while gpu_bytes and weight_bytes / tp > AUTO_WEIGHT_SHARE * gpu_bytes and tp < num_gpus:
        tp *= 2
    if tp == 1:
        known = max((n for n in AUTO_LAYOUTS if n <= num_gpus), default=1)
        dp, tp, ep = AUTO_LAYOUTS[known]
        return (num_gpus // tp, tp, ep) if known == num_gpus else (num_gpus, 1, False)
    return max(1, num_gpus // tp), tp, True


def gpu_memory_bytes() -> int | None:
    """The first visible GPU's memory (nvidia-smi), None when not known."""
    gpus = visible_gpus()
    if not gpus or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                              gpus[0]], capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
