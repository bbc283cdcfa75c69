"""Harnesses for tests, benchmarks, ``kvstrata demo`` and ``kvstrata selftest``.

Real processes and servers on one machine (a sidecar child process, Valkey,
S3 and a loopback Kubernetes control plane), a locally built tiny model,
the one poller they all wait with, reference data and named doubles for
copier tests, and the GPU self-test. Each module's docstring says which
(no list here: a partial one goes stale). Installed with the package so the
command line can run them; never imported by the sidecar, the connector or
the operator.
"""
