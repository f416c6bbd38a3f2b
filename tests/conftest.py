"""Shared pytest fixtures and settings for every test tier."""

from __future__ import annotations

import os

# Triton kernels are checked on the CPU through Triton's interpreter; set it before any
# test module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402  (after TRITON_INTERPRET, which must come first)

# Property tests draw new examples on every run, which finds new bugs on developers' machines
# but would let CI turn red at random. Under CI (CI=true, as .ci/run is run) every property
# test draws the same broad examples each run: hypothesis derives them from the test itself
# (derandomize) and keeps no example database between runs. Locally the default profile
# stays random; `HYPOTHESIS_PROFILE=ci` reproduces CI's draws.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
