"""Measurement: the bench of every recipe against the bandwidth bound and the PyTorch peers (bench, peers), the
per-kernel profiler (profiler), and the FLOP and byte accounting with its roofline (accounting)."""
