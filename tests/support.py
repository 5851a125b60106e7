"""Small helpers several test files share: loading a script of scripts/ as a module, and lowering a jitted function
for CUDA on this CPU machine to read the Triton calls in its StableHLO.

Never runs anything on a device and never changes what it loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from jax import export

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


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
