"""Reusable fakes and fixtures for tests and benchmarks: tiny configs and
models, a discrete-event fake sampler, slot drivers, GGUF files written
here, reference attention, real chat templates.

The top layer: may import anything; nothing in the package imports it.
"""
