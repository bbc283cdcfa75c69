"""The kvstrata cache sidecar.

Nothing in this package imports vLLM or kopf: the sidecar runs in its own
container and must start without either. The entry point is ``kvstrata
sidecar``; ``docs/architecture.md`` maps its modules onto the data path, and
each module's docstring says why it exists. (No module list here: a
partial one goes stale; a test keeps package docstrings to all or none.)
"""
