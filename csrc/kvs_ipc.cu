// CUDA runtime calls of the sidecar's ipc mode, part of libkvstrata-cuda.so.
//
// In ipc mode the sidecar maps vLLM's KV tensors (CUDA IPC memory handles), waits
// for vLLM's interprocess events on its own streams and runs the copy kernels
// (kvs_transfer.cu) between those tensors and its pinned arena, straight or through
// a device staging buffer (malloc, free, async copies). The sidecar image
// need not have torch, so these calls live here, behind the same C ABI (kvs_abi.h),
// with the statically linked cudart of the kernels.
//
// Every entry point returns a cudaError_t and clears the runtime's last-error state
// when it fails: kvs_gather checks its launch with cudaGetLastError, which would
// otherwise report an earlier, unrelated failure of the same thread (an "already
// registered" answer, a closed peer's handle) as its own.
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "kvs_abi.h"
#include "kvs_device_guard.h"
#include "kvs_uuid.h"

namespace kvs {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "the protocol carries 64-byte memory handles");
static_assert(sizeof(cudaIpcEventHandle_t) == 64, "the protocol carries 64-byte event handles");
static_assert(sizeof(cudaUUID_t) == 16, "cudaDeviceProp.uuid is 16 bytes");

// The code to return: a failure also resets the last-error state (see the top).
int done(cudaError_t err) {
  if (err != cudaSuccess) cudaGetLastError();
  return static_cast<int>(err);
}

// The thread's current context, through the runtime's driver entry point so the
// library still needs no -lcuda: cuCtxGetCurrent(CUcontext*) answers without
// creating one (cuda.h), unlike cudaSetDevice. Where the entry point is missing the
// answer is "none", so the guard never restores a device: never a context elsewhere.
bool thread_has_context() {
  using CtxGetCurrent = int (*)(void**);
  static const CtxGetCurrent get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<CtxGetCurrent>(nullptr);
    }
    return reinterpret_cast<CtxGetCurrent>(fn);
  }();
  void* context = nullptr;
  return get_current != nullptr && get_current(&context) == 0 && context != nullptr;
}

struct CudaRuntime {
  int get_device(int* device) { return static_cast<int>(cudaGetDevice(device)); }
  int set_device(int device) { return static_cast<int>(cudaSetDevice(device)); }
  bool has_current_context() { return thread_has_context(); }
};

// Makes `device` current for its lifetime; the thread gets its earlier device back
// only where that device had a context current (kvs_device_guard.h says why).
class OnDevice {
 public:
  explicit OnDevice(int32_t device) : guard_(runtime_, device) {}
  cudaError_t error() const { return static_cast<cudaError_t>(guard_.error()); }

 private:
  CudaRuntime runtime_;
  DeviceGuard<CudaRuntime> guard_;
};

cudaStream_t as_stream(uint64_t handle) {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle));
}

}  // namespace
}  // namespace kvs

extern "C" {

KVS_API int kvs_uuid_parse(const char* text, uint8_t* bytes) {
  return kvs::parse_uuid(text, bytes) ? cudaSuccess : cudaErrorInvalidValue;
}

KVS_API int kvs_cuda_device_by_uuid(const char* uuid, int32_t* device) {
  uint8_t wanted[16];
  if (!kvs::parse_uuid(uuid, wanted)) return cudaErrorInvalidValue;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return kvs::done(err);
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) return kvs::done(err);
    if (memcmp(prop.uuid.bytes, wanted, sizeof(wanted)) == 0) {
      *device = i;
      return cudaSuccess;
    }
  }
  return cudaErrorInvalidDevice;
}

KVS_API int kvs_cuda_set_device(int32_t device) { return kvs::done(cudaSetDevice(device)); }

KVS_API int kvs_cuda_ipc_open(int32_t device, const void* handle, uint64_t* address) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return kvs::done(err);
  *address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
  return cudaSuccess;
}

KVS_API int kvs_cuda_ipc_close(int32_t device, uint64_t address) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  void* ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
  return kvs::done(cudaIpcCloseMemHandle(ptr));
}

KVS_API int kvs_cuda_mem_range(int32_t device, uint64_t address, uint64_t* base, uint64_t* size) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  // A driver call reached through the runtime, so the library still needs no
  // -lcuda: cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr),
  // CUdeviceptr being an unsigned 64-bit integer since CUDA 3.2 (the _v2 ABI).
  using MemGetAddressRange = int (*)(unsigned long long*, size_t*, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess) return kvs::done(err);
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) return cudaErrorNotSupported;
  unsigned long long first = 0;
  size_t bytes = 0;
  if (reinterpret_cast<MemGetAddressRange>(fn)(&first, &bytes, address) != 0) {
    return cudaErrorInvalidValue;
  }
  *base = first;
  *size = bytes;
  return cudaSuccess;
}

KVS_API int kvs_cuda_stream_create(int32_t device, uint64_t* stream) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  cudaStream_t s = nullptr;
  // Non-blocking: the sidecar's copies never wait for (or hold up) work queued on the
  // legacy default stream by anything else in the process.
  const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err != cudaSuccess) return kvs::done(err);
  *stream = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s));
  return cudaSuccess;
}

KVS_API int kvs_cuda_stream_destroy(int32_t device, uint64_t stream) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  return kvs::done(cudaStreamDestroy(kvs::as_stream(stream)));
}

KVS_API int kvs_cuda_stream_wait_ipc_event(int32_t device, uint64_t stream,
                                           const void* event_handle) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  cudaIpcEventHandle_t h;
  memcpy(&h, event_handle, sizeof(h));
  cudaEvent_t event = nullptr;
  cudaError_t err = cudaIpcOpenEventHandle(&event, h);
  if (err != cudaSuccess) return kvs::done(err);
  err = cudaStreamWaitEvent(kvs::as_stream(stream), event, 0);
  // The queued wait keeps what it needs of the event: destroying it now is safe and
  // leaves nothing open per call.
  const cudaError_t destroyed = cudaEventDestroy(event);
  return kvs::done(err != cudaSuccess ? err : destroyed);
}

KVS_API int kvs_cuda_ipc_event_query(int32_t device, const void* event_handle, int32_t* done) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  cudaIpcEventHandle_t h;
  memcpy(&h, event_handle, sizeof(h));
  cudaEvent_t event = nullptr;
  cudaError_t err = cudaIpcOpenEventHandle(&event, h);
  if (err != cudaSuccess) return kvs::done(err);
  const cudaError_t state = cudaEventQuery(event);
  const cudaError_t destroyed = cudaEventDestroy(event);
  if (state != cudaSuccess && state != cudaErrorNotReady) return kvs::done(state);
  *done = state == cudaSuccess ? 1 : 0;
  return kvs::done(destroyed);
}

KVS_API int kvs_cuda_host_register(void* ptr, uint64_t nbytes, uint64_t* device_address,
                                   int32_t* registered) {
  *registered = 0;
  const unsigned int flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
  cudaError_t err = cudaHostRegister(ptr, static_cast<size_t>(nbytes), flags);
  if (err == cudaSuccess) {
    *registered = 1;
  } else if (err == cudaErrorHostMemoryAlreadyRegistered) {
    // torch pinned it (Arena with pin_memory): its registration serves; on a UVA
    // system even flags 0 map it for the device.
    cudaGetLastError();
  } else {
    return kvs::done(err);
  }
  void* dptr = nullptr;
  err = cudaHostGetDevicePointer(&dptr, ptr, 0);
  if (err != cudaSuccess) {
    if (*registered) cudaHostUnregister(ptr);
    *registered = 0;
    return kvs::done(err);
  }
  *device_address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(dptr));
  return cudaSuccess;
}

KVS_API int kvs_cuda_host_unregister(void* ptr) { return kvs::done(cudaHostUnregister(ptr)); }

KVS_API int kvs_cuda_mem_get_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  size_t free_now = 0;
  size_t total = 0;
  const cudaError_t err = cudaMemGetInfo(&free_now, &total);
  if (err != cudaSuccess) return kvs::done(err);
  *free_bytes = free_now;
  *total_bytes = total;
  return cudaSuccess;
}

KVS_API int kvs_cuda_malloc(int32_t device, uint64_t nbytes, uint64_t* address) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) return kvs::done(err);
  *address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
  return cudaSuccess;
}

KVS_API int kvs_cuda_free(int32_t device, uint64_t address) {
  kvs::OnDevice on(device);
  if (on.error() != cudaSuccess) return kvs::done(on.error());
  return kvs::done(cudaFree(reinterpret_cast<void*>(static_cast<uintptr_t>(address))));
}

KVS_API int kvs_cuda_memcpy_async(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream) {
  // cudaMemcpyDefault: with unified addressing the runtime tells pinned host memory
  // from device memory by the address, so one entry point serves both directions.
  return kvs::done(cudaMemcpyAsync(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)),
                                   reinterpret_cast<const void*>(static_cast<uintptr_t>(src)),
                                   static_cast<size_t>(nbytes), cudaMemcpyDefault,
                                   kvs::as_stream(stream)));
}

KVS_API int kvs_cuda_memcpy_batch_async(const uint64_t* dsts, const uint64_t* srcs,
                                        const uint64_t* sizes, uint64_t count,
                                        int32_t src_access_any, uint64_t stream) {
  if (count == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  // One attribute for the whole batch (attrsIdxs {0}); the pointer arrays are read
  // during the call only. uint64_t and void*/size_t have one size on the 64-bit
  // platforms this library builds for.
  static_assert(sizeof(void*) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
                "64-bit addresses and sizes");
  cudaMemcpyAttributes attrs;
  memset(&attrs, 0, sizeof(attrs));
  attrs.srcAccessOrder =
      src_access_any ? cudaMemcpySrcAccessOrderAny : cudaMemcpySrcAccessOrderStream;
  size_t first = 0;
  return kvs::done(cudaMemcpyBatchAsync(reinterpret_cast<void* const*>(dsts),
                                        reinterpret_cast<const void* const*>(srcs),
                                        reinterpret_cast<const size_t*>(sizes),
                                        static_cast<size_t>(count), &attrs, &first, 1,
                                        kvs::as_stream(stream)));
#else
  (void)dsts, (void)srcs, (void)sizes, (void)src_access_any, (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // extern "C"
