"""The served model and device as `kvpilot fit` names them, for the capacity endpoint (`fit_model`,
`fit_device`): the doctor draws the roofline from them when it is given no --model/--gpu."""

from __future__ import annotations

import torch

from kvpilot.model.loader import LoadedModel

# substrings of torch.cuda.get_device_name() -> fit's GPU catalog (kvpilot.fit.hardware.GPUS), most specific first
_GPU_NAMES = (("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("b200", "b200"),
              ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"),
              ("l40s", "l40s"), ("l4", "l4"), ("a10g", "a10g"), ("4090", "rtx-4090"), ("mi300x", "mi300x"))


def fit_model_name(loaded: LoadedModel) -> str:
    """A GGUF file or model directory as loaded (fit reads it where the server runs), the catalog name of a
    dummy model; "" when there is none."""
    if loaded.load_format == "dummy":
        return loaded.source.removeprefix("dummy:")
    return loaded.source


def fit_device_name(device: torch.device) -> str:
    """"cpu", a catalog GPU matched from the CUDA device's name, or "" (fit does not know the device)."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return ""
    name = torch.cuda.get_device_name(device).lower()
    return next((fit for part, fit in _GPU_NAMES if part in name), "")
