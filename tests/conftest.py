"""Shared pytest fixtures and settings for every test tier."""

from __future__ import annotations

import os

# Triton kernels are checked on the CPU through Triton's interpreter; set it before any
# test module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
