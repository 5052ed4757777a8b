"""env: versions, the device and its memory."""

from __future__ import annotations

import platform

import torch

from scripts.gpu_check.check import Check, Entry


def env_section(check: Check) -> Entry:
    import transformers

    entry: Entry = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": check.device,
    }
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        entry |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1),
        }
    return entry
