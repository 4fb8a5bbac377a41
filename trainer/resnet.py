"""A small ResNet (basic blocks) in plain torch, ImageNet-shaped: no torchvision needed."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Four stages of `depth` basic blocks with widths w, 2w, 4w, 8w.

    width=64, depth=2 is ResNet-18. Images of 64 px and more get the ImageNet stem
    (7x7 stride-2 conv + max-pool); smaller ones a 3x3 stem (CIFAR style).
    """

    def __init__(self, *, num_classes: int = 1000, width: int = 64, depth: int = 2,
                 image_size: int = 224, dropout: float = 0.0) -> None:
        super().__init__()
        if image_size >= 64:
            self.stem: nn.Module = nn.Sequential(
                nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for stage in range(4):
            cout = width * 2 ** stage
            for i in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(self.dropout(x))  # type: ignore[no-any-return]
