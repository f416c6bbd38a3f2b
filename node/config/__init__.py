"""Configuration: the layered, validated settings tree (defaults < file < environment < flags),
the daemon's own sections, the generated reference file, and the run spec that every peer of a
run shares.
"""
