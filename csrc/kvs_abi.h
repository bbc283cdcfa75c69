// The C ABI of the kvstrata transfer libraries (see README.md in this directory).
//
// Two libraries export it: the CUDA build (kvs_transfer.cu, nvcc) and the host build
// (kvs_host.cpp, g++). Python binds them with ctypes (kvstrata.sidecar.transfer.kernels),
// so no torch header or Python API appears on either side.
//
// Arguments of kvs_gather / kvs_scatter, in order:
//   layer_addresses   [num_layers] byte address of each layer's block 0, segment 0
//   num_layers        L >= 1
//   block_stride      bytes between consecutive blocks of one layer
//   num_segments      S >= 1 runs per page
//   segment_stride    bytes between consecutive runs of one page
//   segment_bytes     contiguous bytes of one run (> 0)
//   block_outer       chunk order: 0 [layer][block][segment], 1 [block][layer][segment]
//   block_ids         [num_chunks * blocks_per_chunk] paged block of each chunk position;
//                     a negative id skips the position (its destination stays untouched)
//   blocks_per_chunk  P >= 1
//   chunk_addresses   [num_chunks] byte address of each chunk buffer
//   num_chunks        C >= 0
//   max_ctas          CUDA: at most this many thread blocks (0: enough to fill the GPU);
//                     host: ignored
//   stream            CUDA: the cudaStream_t as an integer (0: the legacy default
//                     stream); host: ignored, the copy is done when the call returns
// All three arrays are host memory, read during the call only. The callee trusts its
// inputs (the binding validates them): every block id < num_blocks, no overlap
// between source and destination bytes.
//
// Return: 0, or a cudaError_t value (CUDA build; name it with kvs_cuda_error_name).
#ifndef KVSTRATA_KVS_ABI_H_
#define KVSTRATA_KVS_ABI_H_

#include <stdint.h>

// Bumped whenever a signature or a meaning above changes; the binding refuses a
// library of another version.
#define KVS_ABI_VERSION 4

#define KVS_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

KVS_API int kvs_gather(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                       int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                       int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                       const uint64_t* chunk_addresses, int64_t num_chunks, int32_t max_ctas,
                       uint64_t stream);

KVS_API int kvs_scatter(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                        int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                        int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                        const uint64_t* chunk_addresses, int64_t num_chunks, int32_t max_ctas,
                        uint64_t stream);

// The access width (16, 8, 4, 2 or 1 bytes) a copy with these inputs uses.
KVS_API int kvs_vector_width(const uint64_t* layer_addresses, int32_t num_layers,
                             int64_t block_stride, int64_t segment_stride, int64_t segment_bytes,
                             const uint64_t* chunk_addresses, int64_t num_chunks);

KVS_API int kvs_abi_version(void);
// sha256 of the sources the library was built from (set by the build, see
// kvstrata.sidecar.transfer.csrc_build.source_hash); "unknown" when built by hand.
KVS_API const char* kvs_source_hash(void);
// "cuda" or "host".
KVS_API const char* kvs_backend(void);
// Parse a GPU UUID as nvidia-smi ("GPU-" + 8-4-4-4-12 hex digits), a MIG instance
// ("MIG-" + the same) or torch (no prefix) writes it, in either letter case, into
// its 16 bytes (those of cudaDeviceProp.uuid). Returns 0, or 1 (cudaErrorInvalidValue)
// when `text` is not such a UUID. In both libraries, so the host tests check it.
KVS_API int kvs_uuid_parse(const char* text, uint8_t* bytes);

// CUDA build only.
// The number of CUDA devices the driver shows; returns a cudaError_t (no driver, no
// device, a driver older than the runtime the library was built with, ...).
KVS_API int kvs_cuda_device_count(int32_t* count);
// The CUDA runtime version the library was linked with and the driver's (0: no driver),
// both as 1000 * major + 10 * minor; returns a cudaError_t.
KVS_API int kvs_cuda_versions(int32_t* runtime, int32_t* driver);
// cudaGetErrorName / cudaGetErrorString of a code (static strings).
KVS_API const char* kvs_cuda_error_name(int32_t code);
KVS_API const char* kvs_cuda_error_string(int32_t code);
// Wait for the stream; returns a cudaError_t (a kernel's asynchronous error shows here).
KVS_API int kvs_cuda_stream_synchronize(uint64_t stream);

// CUDA build only: what the sidecar's ipc mode needs (kvs_ipc.cu). Each returns a
// cudaError_t, and a failure leaves no error behind for a later call to pick up (the
// runtime's last-error state is cleared). Functions that take `device` run on it and
// give the calling thread its earlier current device back; kvs_gather / kvs_scatter
// run on the current device, so make it current first (kvs_cuda_set_device).
//
// The device (index as this process numbers them) whose cudaDeviceProp.uuid is `uuid`
// (any form kvs_uuid_parse accepts); cudaErrorInvalidValue for malformed text,
// cudaErrorInvalidDevice when no visible device has it.
KVS_API int kvs_cuda_device_by_uuid(const char* uuid, int32_t* device);
// Make `device` the calling thread's current device.
KVS_API int kvs_cuda_set_device(int32_t device);
// Map another process's allocation from its cudaIpcMemHandle_t (64 bytes) into this
// process (peer access enabled lazily); `*address` is the device address of its first
// byte. The driver counts opens of one handle (the same address comes back): close
// each with kvs_cuda_ipc_close. While it is open the memory stays allocated even after
// the exporter frees it or dies; the last close gives it back.
KVS_API int kvs_cuda_ipc_open(int32_t device, const void* handle, uint64_t* address);
KVS_API int kvs_cuda_ipc_close(int32_t device, uint64_t address);
// The allocation `address` lies in (the driver's cuMemGetAddressRange): its first
// byte's address and its size in bytes. Returns cudaErrorNotSupported when the
// driver does not offer the call.
KVS_API int kvs_cuda_mem_range(int32_t device, uint64_t address, uint64_t* base, uint64_t* size);
// A stream of `device` that does not synchronise with the legacy default stream.
KVS_API int kvs_cuda_stream_create(int32_t device, uint64_t* stream);
KVS_API int kvs_cuda_stream_destroy(int32_t device, uint64_t stream);
// Make `stream` wait (on the GPU, the host does not block) for the last record of
// another process's event, named by its cudaIpcEventHandle_t (64 bytes). The event
// is opened for this call and released; the wait stays queued.
KVS_API int kvs_cuda_stream_wait_ipc_event(int32_t device, uint64_t stream,
                                           const void* event_handle);
// Whether the last record of another process's event has completed (`*done` 1 or
// 0), asked from the host without blocking; the event is opened for this call only.
KVS_API int kvs_cuda_ipc_event_query(int32_t device, const void* event_handle, int32_t* done);
// Page-lock `nbytes` of host memory at `ptr` for every device (portable) and map it
// for kernels (mapped), on the current device; `*device_address` is the address
// kernels of the current device use for `ptr`. Memory that is already registered (by
// torch, say) is left as it is and only its device address is returned;
// `*registered` says whether this call registered it (1) or not (0), so that only its
// registrant unregisters it.
KVS_API int kvs_cuda_host_register(void* ptr, uint64_t nbytes, uint64_t* device_address,
                                   int32_t* registered);
// Undo kvs_cuda_host_register (before the memory is unmapped).
KVS_API int kvs_cuda_host_unregister(void* ptr);
// Free and total memory of `device` in bytes (cudaMemGetInfo: device-wide).
KVS_API int kvs_cuda_mem_get_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes);
// The staging copy path (CudaDevice's copy_path "staging"): a device buffer the
// kernels fill or drain at device-memory speed, moved to and from the pinned arena by
// the copy engines. `nbytes` of device memory on `device` (cudaMalloc);
// `*address` is its first byte.
KVS_API int kvs_cuda_malloc(int32_t device, uint64_t nbytes, uint64_t* address);
// Give back what kvs_cuda_malloc allocated on `device` (cudaFree: waits for the device).
KVS_API int kvs_cuda_free(int32_t device, uint64_t address);
// Queue a copy of `nbytes` from `src` to `dst` on `stream` (cudaMemcpyAsync, kind
// cudaMemcpyDefault: the direction comes from the addresses). Both are addresses the
// stream's device can use: device memory, or pinned host memory by its device address.
// Runs on the current device like kvs_gather: make the stream's device current first.
KVS_API int kvs_cuda_memcpy_async(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream);
// Queue `count` copies srcs[i] -> dsts[i] of sizes[i] bytes on `stream` in one
// driver call (cudaMemcpyBatchAsync, CUDA 12.8+): what vLLM's OffloadingConnector
// submits per transfer (swap_blocks_batch). The batch runs in stream order, its
// copies in no order among themselves. `src_access_any` != 0 lets the copy engines
// read the sources out of stream order (only where no stream still writes them).
// cudaErrorNotSupported where the runtime this library was built with is older.
KVS_API int kvs_cuda_memcpy_batch_async(const uint64_t* dsts, const uint64_t* srcs,
                                        const uint64_t* sizes, uint64_t count,
                                        int32_t src_access_any, uint64_t stream);

#ifdef __cplusplus
}
#endif

#endif  // KVSTRATA_KVS_ABI_H_
