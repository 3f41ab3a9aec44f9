"""A model with every awkward feature a DDP wrapper must handle, and the single-process reference loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AwkwardModel(nn.Module):
    """Tied weight, frozen layer, a parameter unused in forward, a bf16 branch, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, bias=False)
        self.hidden = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(16, 4)
        self.bf16_branch = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.hidden(self.embed(x))) * self.scale
        h = self.frozen(h)
        main = F.linear(h, self.embed.weight.t())  # the tied use: (B, 16) -> (B, 8)
        side = self.bf16_branch(x.bfloat16())
        return main, side


def loss_fn(outputs, target) -> torch.Tensor:
    """The bf16 branch enters linearly, so its rounding never feeds the fp32 parameters' gradients."""
    main, side = outputs
    return F.mse_loss(main, target) + (side.float() * 0.1).mean()


def make_model(seed: int, device) -> AwkwardModel:
    torch.manual_seed(seed)
    return AwkwardModel().to(device)


def make_batches(steps: int, batch: int, device):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(batch, 8, generator=g).to(device), torch.randn(batch, 8, generator=g).to(device))
            for _ in range(steps)]


def assert_params_close(model: nn.Module, ref: nn.Module, step: int, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        tol = 2e-2 if p.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(p.detach().float(), q.detach().float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{what}: step {step}, parameter {name}: {m}")
