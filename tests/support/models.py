"""Small real models for tests (and a ResNet-50-shaped one for the plan CLI:
``tensorx plan tests.support.models:resnet50``).

Built from torch layers only (torchvision is not a dependency). Every factory is seeded so
two calls give the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TwoStage", "cnn", "mlp", "resnet50", "small_mlp", "sparse_embedding", "transformer",
           "two_stage"]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def small_mlp(seed: int = 0, hidden: int = 16) -> nn.Module:
    """8 -> ``hidden`` (tanh) -> 3: the model the parameter-server tests train."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def transformer(layers: int = 2, d_model: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)


class SparseEmbedding(nn.Module):
    """Embedding + EmbeddingBag with sparse gradients feeding a dense head."""

    def __init__(self, rows: int = 1000, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.bag = nn.EmbeddingBag(rows // 2, dim // 2, mode="sum", sparse=True)
        self.head = nn.Linear(dim + dim // 2, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a = self.emb(ids).mean(dim=1)
        b = self.bag(ids % self.bag.num_embeddings)
        return self.head(torch.cat([a, b], dim=1))  # type: ignore[no-any-return]


def sparse_embedding(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SparseEmbedding()


class TwoStage(nn.Module):
    """Two stages meant for two devices, with a skip edge from stage 0 to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage0(x)
        return self.stage1(h) + h[:, :8]  # type: ignore[no-any-return]


def two_stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TwoStage()


# -- ResNet-50, layer for layer (161 parameter tensors, 25,557,032 parameters) ----------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride,
                                                      bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(y + skip)  # type: ignore[no-any-return]


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1 = self._layer(64, 3, 1)
        self.layer2 = self._layer(128, 4, 2)
        self.layer3 = self._layer(256, 6, 2)
        self.layer4 = self._layer(512, 3, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [Bottleneck(self.inplanes, planes, stride)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


def resnet50(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ResNet50()
