"""Custom operators registered through ``torch.library`` (C++ on CPU, Triton on CUDA).

Importing this package registers the ops (cheap); the C++ kernels compile on their first CPU call
and are cached on disk (see :mod:`torchturbo.kernels._build`); the Triton kernels are imported on
the first CUDA call and compiled by Triton (cached by Triton). Where one cannot be built (no
g++/ninja; no triton), that device runs the composite and a RuntimeWarning says so once.
"""

from torchturbo.kernels._build import build_directory, cpu_kernel_error, load_cpu_kernels
from torchturbo.kernels.bias_gelu import LinearGELU, bias_gelu, bias_gelu_reference

__all__ = [
    "LinearGELU",
    "bias_gelu",
    "bias_gelu_reference",
    "build_directory",
    "cpu_kernel_error",
    "load_cpu_kernels",
]
