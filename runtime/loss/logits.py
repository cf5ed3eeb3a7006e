"""What models do to the LM head's output before the softmax: a scale, then a tanh soft cap.

Both act in place on a fresh fp32 block of logits, so a chunked loss never makes a second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """y = softcap * tanh(scale * z / softcap), or y = scale * z without a cap (z: the head's raw output).

    The scale comes first because models that have one (Cohere's logit_scale, Granite's 1 / logits_scaling)
    apply it to the head's output; Gemma-2 / Grok cap whatever the head produced last.
    """

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        if not self.scale or self.scale != self.scale:
            raise ValueError(f"logit_scale must be a finite non-zero number, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap}")

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return z.mul_(self.scale) if self.scale != 1.0 else z
        return z.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def slope(self, y: torch.Tensor) -> torch.Tensor | float:
        """dy / dz from the transformed values `y`: the scale alone without a cap (no tensor is made),
        else scale * (1 - tanh^2) as a new tensor; taken before a block is overwritten by its softmax."""
        if self.softcap is None:
            return self.scale
        return y.square().mul_(-self.scale / self.softcap**2).add_(self.scale)
