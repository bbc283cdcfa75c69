"""The kvstrata cache sidecar.

Nothing in this package imports vLLM or kopf: the sidecar runs in its own
container and must start without either.

Modules:

* :mod:`.config`     the one typed config schema (CRD spec -> ConfigMap -> loader)
* :mod:`.keys`       namespaces, chunk keys and the vLLM block-hash chain
* :mod:`.objformat`  the header every object below L1 carries
* :mod:`.codecs`     optional lossless codecs for objects below L1
* :mod:`.tiers`      L2 disk, Valkey and S3 tiers behind one interface
"""
