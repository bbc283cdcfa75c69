"""The transfer path: moving chunks between vLLM's paged KV and chunk buffers.

``plan`` reads the byte geometry of vLLM's KV tensors; ``torch_copy`` moves
bytes by it with torch on any device; ``kernels`` binds the ``csrc/`` CUDA
kernels (and their host build) that move all layers of many chunks in one
launch. Nothing here imports vLLM; torch is imported only by the modules
that copy, so the sidecar runs without it in host mode.
"""
