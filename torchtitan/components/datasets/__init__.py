from torchtitan.components.datasets.documents import DATASETS
from torchtitan.components.datasets.text import TextDataset, build_dataloader

__all__ = ["DATASETS", "TextDataset", "build_dataloader"]
