"""Exceptions raised by wanswarm.kernels::

    KernelError
    ├── UnsupportedInput     wrong dtype, shape, device or non-contiguous tensor; unknown codec
    ├── NonFiniteInput       NaN or Inf where a codec cannot represent it
    └── RegistrationError    a codec entry that breaks the registry's rules (name, id, layout),
                             or a codec function whose result breaks its layout
"""

from __future__ import annotations


class KernelError(Exception):
    """Base class of every error raised by wanswarm.kernels."""


class UnsupportedInput(KernelError, ValueError):
    """A tensor the kernel cannot take: wrong dtype, shape, device or layout."""


class NonFiniteInput(KernelError, ValueError):
    """NaN or Inf in a tensor that a quantizing codec cannot represent."""


class RegistrationError(KernelError, ValueError):
    """A codec that cannot be registered, or whose functions return what its layout forbids."""
