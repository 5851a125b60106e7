"""pallas_kernels/ stays a leaf: its modules import only the standard library, jax, jax-triton, triton and numpy, and
of each other only public names (shared helpers live in modules of their own, such as tiling.py). The import-linter
contract (pyproject.toml) keeps qwen_jax, sharding and server out; this checks what it cannot: third-party packages
and private names."""

import ast
import pathlib
import sys

import pytest

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "pallas_kernels"
ALLOWED = {"jax", "jax_triton", "triton", "numpy", "pallas_kernels"} | set(sys.stdlib_module_names)


def violations(source: str) -> list[str]:
    """What a kernel module's source imports against the rules: a package outside ALLOWED, a private name of another
    kernel module (imported by name or read as an attribute of the module)."""
    tree = ast.parse(source)
    found, kernel_modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED:
                    found.append(f"import {alias.name}")
                if alias.name.startswith("pallas_kernels."):
                    kernel_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module.split(".")[0] not in ALLOWED:
                found.append(f"from {node.module} import ...")
            if node.module.startswith("pallas_kernels"):
                found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
                if node.module == "pallas_kernels":
                    kernel_modules.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in kernel_modules and node.attr.startswith("_"):
            found.append(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_kernel_module_imports_only_its_allowed_packages_and_public_names(path):
    assert violations(path.read_text()) == []


def test_the_check_catches_each_kind_of_violation():
    source = ("import torch\nfrom qwen_jax.layers import mlp\nfrom pallas_kernels.tiling import _private\n"
              "from pallas_kernels import moe_gemm\nmoe_gemm._tile(1, 2)\nimport jax.numpy as jnp\n")
    assert violations(source) == ["import torch", "from qwen_jax.layers import ...",
                                  "from pallas_kernels.tiling import _private", "moe_gemm._tile"]
