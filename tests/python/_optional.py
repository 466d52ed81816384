"""The optional packages of the Python tests and the skip markers built on them: the tests without torch (or numpy)
still run, and those that need them skip with the reason."""
import pytest

try:
    import torch
except ImportError:
    torch = None

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch here
    np = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
