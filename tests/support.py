"""Small helpers several test files share: where the shared test data is, loading a script of scripts/ as a module,
and lowering a jitted function for CUDA on this CPU machine to read the Triton calls in its StableHLO.

Never runs anything on a device and never changes what it loads.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from jax import export

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
# The shared test data (tokenizer, configs, GSM8K, the trained tiny LLaMA; its SOURCES.md says where each comes from):
# $QWEN_JAX_TEST_DATA, else ../shared/data beside this checkout.
DATA_ENV = "QWEN_JAX_TEST_DATA"


def shared_data(*parts: str) -> Path:
    """A path in the shared test data. A missing one is an error naming where it was looked for, never a skip."""
    root = Path(os.environ.get(DATA_ENV) or REPO_ROOT.parent / "shared" / "data")
    path = root.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"shared test data missing: {path} (set ${DATA_ENV} to the folder that holds "
                                f"qwen3_5_tokenizer/, configs/, gsm8k/ and tiny_llama/)")
    return path


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_mlir(fn, *args) -> str:
    """The StableHLO text of `fn` (jitted) lowered for CUDA with `args` (ShapeDtypeStructs), Triton calls allowed."""
    exported = export.export(fn, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exported.mlir_module()
