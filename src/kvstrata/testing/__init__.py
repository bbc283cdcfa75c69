"""Harnesses for tests and benchmarks: never imported by the runtime package."""
