"""Datasets of the reference script: deterministic synthetic images, or an image folder.

Both are map-style and deterministic per (seed, index), so any data order can be replayed
exactly after a resume.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .errors import SpottrainerError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".gif"})


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """`size` random images whose class shifts the channel means (so the task is learnable)."""

    def __init__(self, size: int, *, image_size: int, num_classes: int, seed: int) -> None:
        self.size = size
        self.image_size = image_size
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        image = torch.randn(3, self.image_size, self.image_size, generator=g)
        means = torch.tensor([(label * k % self.num_classes) / self.num_classes - 0.5
                              for k in (1, 7, 13)])
        return image * 0.5 + means.view(3, 1, 1), label


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """`root/<class>/<image>`: classes are sorted subdirectory names; images decoded by PIL,
    resized (shorter side) and centre-cropped to `image_size`, ImageNet-normalised."""

    MEAN = (0.485, 0.456, 0.406)
    STD = (0.229, 0.224, 0.225)

    def __init__(self, root: Path, *, image_size: int) -> None:
        try:
            self._pil: Any = importlib.import_module("PIL.Image")
        except ImportError as err:
            raise SpottrainerError(
                "--data PATH needs Pillow to decode images (pip install pillow); "
                "or use --data synthetic", root) from err
        if not root.is_dir():
            raise SpottrainerError("image folder does not exist", root)
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((root / name).rglob("*"))
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise SpottrainerError("no images found in class subdirectories", root)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with self._pil.open(path) as img:
            img = img.convert("RGB")
            w, h = img.size
            scale = self.image_size / min(w, h)
            img = img.resize((max(self.image_size, round(w * scale)),
                              max(self.image_size, round(h * scale))))
            w, h = img.size
            left, top = (w - self.image_size) // 2, (h - self.image_size) // 2
            img = img.crop((left, top, left + self.image_size, top + self.image_size))
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        x = data.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float() / 255.0
        mean = torch.tensor(self.MEAN).view(3, 1, 1)
        std = torch.tensor(self.STD).view(3, 1, 1)
        return (x - mean) / std, label
