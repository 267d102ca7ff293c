"""The small residual MLP the tensor-parallel and sharded-run tests shard: two blocks of
LayerNorm -> fc1 (ColwiseParallel) -> ReLU -> fc2 (RowwiseParallel) + skip, then a head."""

from __future__ import annotations

import torch

D = 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 4 * D)
        self.fc2 = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(D, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
