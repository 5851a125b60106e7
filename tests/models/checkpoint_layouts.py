"""The tensor layouts HF checkpoints ship, made from a save_pretrained state dict: per-expert or fused experts, the
multimodal `model.language_model.` prefix, several shards with an index. Shared by the model tests.

Renames and regroups tensors only; never changes a value.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def language_model_layout(state: dict) -> dict:
    """The multimodal checkpoint layout: the decoder under model.language_model.; top-level tensors (lm_head, mtp.*)
    stay where they are."""
    return {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}


def fused_experts(state: dict) -> dict:
    """Fused experts as the HF modules hold them: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    out, experts = {}, {}
    for name, value in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[:i + 1]), {}).setdefault(parts[i + 2], {})[int(parts[i + 1])] = value
        else:
            out[name] = value
    for prefix, proj in experts.items():
        stacked = {kind: torch.stack([per[e] for e in sorted(per)]) for kind, per in proj.items()}
        out[prefix + ".gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1).contiguous()
        out[prefix + ".down_proj"] = stacked["down_proj"].contiguous()
    return out


def per_expert(state: dict) -> dict:
    """fused_experts' inverse: one tensor per expert and projection, as save_pretrained writes them."""
    out = {}
    for name, value in state.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[name] = value
    return out


def save_sharded(state: dict, directory: Path, num_files: int = 2) -> None:
    """`state` as num_files safetensors files and a model.safetensors.index.json naming each tensor's file."""
    names = sorted(state)
    weight_map = {}
    for i in range(num_files):
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = names[i::num_files]
        save_file({n: state[n].contiguous() for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
