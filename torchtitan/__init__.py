"""A PyTorch-native framework for pre-training Llama 3.1 models with composable N-D parallelism."""

__version__ = "0.1.0"
