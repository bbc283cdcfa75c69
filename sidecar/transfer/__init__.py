"""The transfer path: moving chunks between vLLM's paged KV and chunk buffers.

* :mod:`.plan`: the byte geometry of vLLM's KV tensors, read from strides
* :mod:`.torch_copy`: moves bytes by a plan with torch on any device
* :mod:`.kernels`: loads the ``csrc/`` CUDA kernels (and their host build)
  that move all layers of many chunks in one launch
* :mod:`.kernel_binding`: the ctypes binding of a loaded library (copies, CUDA runtime calls)
* :mod:`.abi`: the C ABI of those libraries, declarations and argument checks
* :mod:`.csrc_build`: how the ``csrc/`` libraries are compiled
* :mod:`.cuda_device`: the sidecar's GPUs in ipc mode (IPC handles, copies)
* :mod:`.arena_registration`: the L1 arena page-locked for every GPU, once
* :mod:`.staging`: the staging copy path (a device buffer and the copy engines)
* :mod:`.peer_events`: waiting on the host for vLLM's interprocess events
* :mod:`.ipc`: the ipc transfer mode, in which the sidecar copies itself
* :mod:`.kv_registration`: REGISTER_KV's checks: handles opened, tensors bounded, copies planned
* :mod:`.ipc_mapping`: one session's registered KV, and the block ids a copy may name
* :mod:`.ipc_device`: what ipc mode asks of a GPU, its error type and sticky CUDA errors

Nothing here imports vLLM; torch is imported only by the modules that copy,
so the sidecar runs without it in host mode.
"""
