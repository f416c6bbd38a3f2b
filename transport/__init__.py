"""wanswarm.transport: authenticated QUIC requests with FEC-protected tensor payloads.

Knows bytes and tensors, nothing of models. Depends on wanswarm.kernels only.
"""
