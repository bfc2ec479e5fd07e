"""Host data onto the device without making the host wait.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory synchronises the host
with the stream. Everything a step uploads (token ids, positions, slots, block tables,
sampling parameters) goes through :func:`upload` instead: on CUDA it is staged in pinned
memory (torch's caching host allocator, so no allocation after warm-up) and copied
asynchronously, in stream order. Elsewhere it is just a tensor on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def upload(
    data: np.ndarray | list[Any], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``data`` (an array, or a list of numbers) as a ``dtype`` tensor on ``device``."""
    device = torch.device(device)
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
