"""Benchmarks that drive the real services on this machine (not timed tests): `python -m bench`."""
