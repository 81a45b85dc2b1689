"""The one skip of the tests that need a CUDA device: every GPU test skips cleanly without one,
naming why, and the tests of what happens without CUDA skip where there is one."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: torch sees no CUDA device on this host")
without_cuda = pytest.mark.skipif(
    HAS_CUDA, reason="checks the behaviour without CUDA; this host has a CUDA device"
)
