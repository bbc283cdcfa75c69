"""kvstrata: a Kubernetes-native, tiered KV cache for vLLM.

Subpackages (``sidecar/``, ``connector/``, ``operator/`` and ``bench/`` at the
repository root are mapped into this package by ``pyproject.toml``):

* :mod:`kvstrata.sidecar`   the cache sidecar: engine, tiers, transfer, server
* :mod:`kvstrata.connector` the vLLM KV connector (client side)
* :mod:`kvstrata.operator`  the kopf operator and admission webhook
* :mod:`kvstrata.bench`     benchmarks (``kvstrata bench NAME``)
* :mod:`kvstrata.testing`   harnesses for tests, benchmarks, demo and self-test
* :mod:`kvstrata.refdocs`   the reference pages ``make docs`` generates

and modules :mod:`.cli` (the ``kvstrata`` command), :mod:`.demo`
(``kvstrata demo``), :mod:`.demo_table` (what the demo measured and prints),
:mod:`.metricsdoc` (``docs/metrics.md``) and :mod:`.chartpackage` (``make chart``).
"""

__version__ = "0.1.0"
