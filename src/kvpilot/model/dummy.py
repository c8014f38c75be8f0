"""Dummy (random) weights for any supported architecture, like vLLM's `--load-format dummy`.

The config comes from a config.json file/directory or the built-in catalog (`kvpilot.fit.model_catalog`),
so large architectures can be benchmarked without their weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvpilot.fit.model_catalog import UnknownModelError, get_hf_config
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.hf_dir import read_hf_config
from kvpilot.model.parallel.shard_plan import ShardPlan

DUMMY_INIT_STD = 0.02  # small weights keep activations finite through many layers


def dummy_hf_config(name_or_path: str) -> dict[str, Any]:
    """HF config dict for a dummy model: a config.json (file or its directory) or a catalog name."""
    path = Path(name_or_path)
    if path.is_dir():
        return read_hf_config(path)
    if path.is_file():
        return read_hf_config(path.parent) if path.name == "config.json" else _read_json(path)
    try:
        return get_hf_config(name_or_path)
    except UnknownModelError as exc:
        raise ModelLoadError(f"dummy model {name_or_path!r}: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: malformed JSON config ({exc})") from exc


@torch.no_grad()
def init_dummy_weights(module: torch.nn.Module, seed: int = 0, shard: ShardPlan | None = None) -> None:
    """Fills every parameter in place: norms with 1, everything else N(0, DUMMY_INIT_STD), reproducibly for a
    given seed and device (each device draws from its own generator: an 8B model drawn on the CPU and
    copied would take about a minute). With `shard` (a tensor-parallel rank's plan, `module` built from its
    local config) each parameter is drawn whole, as one rank would, and the rank's part kept: the ranks
    hold exactly the one-rank model's weights, one whole tensor at a time."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if shard is None:
            param.normal_(0.0, DUMMY_INIT_STD, generator=generators[param.device])
            continue
        whole = torch.empty(shard.full_shape(name, param.shape), dtype=param.dtype, device=param.device)
        whole.normal_(0.0, DUMMY_INIT_STD, generator=generators[param.device])
        param.copy_(shard.take_fused(name, whole))
