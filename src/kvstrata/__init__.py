"""kvstrata: a Kubernetes-native, tiered KV cache for vLLM.

Subpackages:

* :mod:`kvstrata.sidecar`   the cache sidecar: engine, tiers, transfer, server
* :mod:`kvstrata.connector` the vLLM KV connector (client side)
* :mod:`kvstrata.operator`  the kopf operator and admission webhook
* :mod:`kvstrata.bench`     benchmarks (``kvstrata bench NAME``)
"""

__version__ = "0.1.0"
