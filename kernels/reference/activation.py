"""SiLU-and-multiply, the gate of a SwiGLU MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``(..., 2 * d)`` holding ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
