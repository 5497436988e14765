from torchtitan.components.datasets.text import DATASETS, TextDataset, build_dataloader

__all__ = ["DATASETS", "TextDataset", "build_dataloader"]
