"""A PyTorch-native framework for pre-training Llama 3.1 models with composable N-D parallelism."""

__version__ = "0.1.0"

from torchtitan.tools.logging import filter_known_third_party_noise

filter_known_third_party_noise()
