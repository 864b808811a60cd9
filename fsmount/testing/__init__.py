"""Helpers for tests and benchmarks: a local SeaweedFS S3 server and deterministic safetensors models.

Nothing here is imported by the filesystem itself; it must never be needed at mount time.
"""
