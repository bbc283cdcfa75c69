// CUDA gather/scatter between vLLM's paged KV and contiguous chunk buffers.
//
// One launch moves every layer of every chunk of a call. Work items (one piece of one
// unit, see kvs_index.h) are spread over a grid sized to the GPU, each thread block
// walking items with a grid-stride loop; inside an item each thread keeps kUnroll
// vector loads in flight before it stores them. The access width is chosen once per
// launch on the host (kvs::vector_width): 16-byte uint4 accesses whenever every
// address, stride and length allows, else 8, 4, 2 or 1 bytes.
//
// Chunk buffers may be device memory or pinned host memory mapped for the device
// (zero-copy over PCIe); pages are device memory. Only cuda_runtime.h is included:
// the library links cudart statically and knows nothing of torch.
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "kvs_abi.h"
#include "kvs_index.h"

#ifndef KVS_SOURCE_HASH
#define KVS_SOURCE_HASH "unknown"
#endif

namespace kvs {
namespace {

// The per-call tables (layer addresses, chunk addresses, block ids) travel inside the
// kernel parameters when they fit: parameters are copied with the launch itself, so
// the common call costs no extra copy, allocation or host synchronisation. 480 words
// keep Params under the 4 KiB that every driver accepts (32 KiB needs a CUDA 12.1
// driver and would be copied whole at every launch); that covers e.g. 128 layers and
// 20 chunks of 16 blocks. Larger calls put the tables in stream-ordered scratch.
constexpr int kInlineWords = 480;

struct Params {
  Geometry g;
  int64_t num_chunks;
  int64_t num_items;    // work items of the call
  int64_t pieces;       // pieces per unit
  int64_t piece_bytes;  // a multiple of the access width
  // Device copy of the tables, or nullptr when they are in `words`. Layout of both:
  // [layer addresses: L][chunk addresses: C][block ids: C * P, int64 bits].
  const uint64_t* table;
  int32_t gather;  // 1: pages -> chunks, 0: chunks -> pages
  uint64_t words[kInlineWords];
};
static_assert(sizeof(Params) <= 4096, "kernel parameters over 4 KiB need a CUDA 12.1 driver");

template <int W>
struct VecOf;
template <>
struct VecOf<16> {
  using T = uint4;
};
template <>
struct VecOf<8> {
  using T = uint2;
};
template <>
struct VecOf<4> {
  using T = unsigned int;
};
template <>
struct VecOf<2> {
  using T = unsigned short;
};
template <>
struct VecOf<1> {
  using T = unsigned char;
};

// Evict-first accesses: every byte is touched once, so keep vLLM's working set in L2.
template <typename T>
__device__ __forceinline__ T load_once(const T* p) {
  return __ldcs(p);
}
template <typename T>
__device__ __forceinline__ void store_once(T* p, T v) {
  __stcs(p, v);
}

// Copy n vectors; every thread of the block calls it with the same arguments.
template <typename V>
__device__ __forceinline__ void copy_piece(const V* __restrict__ src, V* __restrict__ dst,
                                           int64_t n) {
  constexpr int64_t kRound = static_cast<int64_t>(kThreads) * kUnroll;
  int64_t i = threadIdx.x;
  // Whole rounds: kUnroll independent loads issued before the first store.
  for (; i + static_cast<int64_t>(kUnroll - 1) * kThreads < n; i += kRound) {
    V r[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) r[j] = load_once(src + i + j * kThreads);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) store_once(dst + i + j * kThreads, r[j]);
  }
  // The last, partial round of this thread.
  V r[kUnroll] = {};
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (i + j * kThreads < n) r[j] = load_once(src + i + j * kThreads);
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (i + j * kThreads < n) store_once(dst + i + j * kThreads, r[j]);
  }
}

template <int W>
__global__ void __launch_bounds__(kThreads) copy_kernel(const __grid_constant__ Params p) {
  using V = typename VecOf<W>::T;
  // Taking the address of a __grid_constant__ parameter reads it in place.
  const uint64_t* table = p.table != nullptr ? p.table : p.words;
  const uint64_t* layer_addresses = table;
  const uint64_t* chunk_addresses = table + p.g.num_layers;
  const int64_t* block_ids = reinterpret_cast<const int64_t*>(chunk_addresses + p.num_chunks);
  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    const Work w = work_item(p.g, item, p.pieces, p.piece_bytes);
    const Unit u = unit_coords(p.g, w.unit);
    const int64_t block = block_ids[u.chunk * p.g.blocks_per_chunk + u.position];
    if (block < 0) continue;  // a skipped position: the same for the whole thread block
    char* page = reinterpret_cast<char*>(
        page_address(p.g, layer_addresses[u.layer], block, u.segment) + w.begin);
    char* chunk = reinterpret_cast<char*>(
        chunk_addresses[u.chunk] + chunk_offset(p.g, u.layer, u.position, u.segment) + w.begin);
    const char* src = p.gather ? page : chunk;
    char* dst = p.gather ? chunk : page;
    copy_piece<V>(reinterpret_cast<const V*>(src), reinterpret_cast<V*>(dst),
                  (w.end - w.begin) / W);
  }
}

// Resident thread blocks per SM of copy_kernel<W>, asked once per width.
template <int W>
cudaError_t blocks_per_sm(int* out) {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    const cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, copy_kernel<W>, kThreads, 0);
    if (err != cudaSuccess) return err;
    if (n < 1) n = 1;
    cached.store(n, std::memory_order_relaxed);
  }
  *out = n;
  return cudaSuccess;
}

template <int W>
cudaError_t launch(Params& p, int32_t max_ctas, cudaStream_t stream) {
  int device = 0;
  int sms = 0;
  int per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = blocks_per_sm<W>(&per_sm);
  if (err != cudaSuccess) return err;
  int64_t ctas = static_cast<int64_t>(sms) * per_sm;
  if (max_ctas > 0 && max_ctas < ctas) ctas = max_ctas;

  // Longer pieces while there are still at least 4 items per resident thread block:
  // fewer index computations per byte, the same parallelism.
  const int64_t units = p.num_chunks * units_per_chunk(p.g);
  int64_t piece = base_piece_bytes(W);
  while (piece < p.g.segment_bytes && piece < 16 * base_piece_bytes(W) &&
         units * pieces_per_unit(p.g, 2 * piece) >= 4 * ctas) {
    piece *= 2;
  }
  p.piece_bytes = piece;
  p.pieces = pieces_per_unit(p.g, piece);
  p.num_items = units * p.pieces;
  const int64_t grid = p.num_items < ctas ? p.num_items : ctas;
  copy_kernel<W><<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

int copy(int32_t gather, const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
         int32_t num_segments, int64_t segment_stride, int64_t segment_bytes, int32_t block_outer,
         const int64_t* block_ids, int32_t blocks_per_chunk, const uint64_t* chunk_addresses,
         int64_t num_chunks, int32_t max_ctas, uint64_t stream_handle) {
  if (num_chunks <= 0) return cudaSuccess;
  Params p;
  p.g = Geometry{block_stride,  segment_stride,   segment_bytes, num_layers,
                 num_segments, blocks_per_chunk, block_outer};
  p.num_chunks = num_chunks;
  p.gather = gather;
  p.table = nullptr;
  const int width = vector_width(p.g, layer_addresses, chunk_addresses, num_chunks);

  const int64_t num_ids = num_chunks * blocks_per_chunk;
  const int64_t num_words = num_layers + num_chunks + num_ids;
  const size_t layer_bytes = sizeof(uint64_t) * static_cast<size_t>(num_layers);
  const size_t chunk_bytes = sizeof(uint64_t) * static_cast<size_t>(num_chunks);
  const size_t id_bytes = sizeof(int64_t) * static_cast<size_t>(num_ids);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_handle));
  std::vector<uint64_t> staged;
  uint64_t* words = p.words;
  if (num_words > kInlineWords) {
    staged.resize(static_cast<size_t>(num_words));
    words = staged.data();
  }
  memcpy(words, layer_addresses, layer_bytes);
  memcpy(words + num_layers, chunk_addresses, chunk_bytes);
  memcpy(words + num_layers + num_chunks, block_ids, id_bytes);

  void* scratch = nullptr;
  if (!staged.empty()) {
    // The copy from pageable memory is staged before cudaMemcpyAsync returns, so
    // `staged` may go when this function does; the kernel is ordered after it.
    const size_t nbytes = staged.size() * sizeof(uint64_t);
    cudaError_t err = cudaMallocAsync(&scratch, nbytes, stream);
    if (err != cudaSuccess) return err;
    err = cudaMemcpyAsync(scratch, staged.data(), nbytes, cudaMemcpyHostToDevice, stream);
    if (err != cudaSuccess) {
      cudaFreeAsync(scratch, stream);
      return err;
    }
    p.table = static_cast<const uint64_t*>(scratch);
  }

  cudaError_t err;
  switch (width) {
    case 16:
      err = launch<16>(p, max_ctas, stream);
      break;
    case 8:
      err = launch<8>(p, max_ctas, stream);
      break;
    case 4:
      err = launch<4>(p, max_ctas, stream);
      break;
    case 2:
      err = launch<2>(p, max_ctas, stream);
      break;
    default:
      err = launch<1>(p, max_ctas, stream);
      break;
  }
  if (scratch != nullptr) {
    const cudaError_t free_err = cudaFreeAsync(scratch, stream);
    if (err == cudaSuccess) err = free_err;
  }
  return err;
}

}  // namespace
}  // namespace kvs

extern "C" {

KVS_API int kvs_gather(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                       int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                       int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                       const uint64_t* chunk_addresses, int64_t num_chunks, int32_t max_ctas,
                       uint64_t stream) {
  return kvs::copy(1, layer_addresses, num_layers, block_stride, num_segments, segment_stride,
                   segment_bytes, block_outer, block_ids, blocks_per_chunk, chunk_addresses,
                   num_chunks, max_ctas, stream);
}

KVS_API int kvs_scatter(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                        int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                        int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                        const uint64_t* chunk_addresses, int64_t num_chunks, int32_t max_ctas,
                        uint64_t stream) {
  return kvs::copy(0, layer_addresses, num_layers, block_stride, num_segments, segment_stride,
                   segment_bytes, block_outer, block_ids, blocks_per_chunk, chunk_addresses,
                   num_chunks, max_ctas, stream);
}

#define KVS_BACKEND_NAME "cuda"
#include "kvs_common.h"

KVS_API int kvs_cuda_device_count(int32_t* count) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  *count = err == cudaSuccess ? n : 0;
  return err;
}

KVS_API int kvs_cuda_versions(int32_t* runtime, int32_t* driver) {
  int r = 0;
  int d = 0;
  cudaError_t err = cudaRuntimeGetVersion(&r);
  if (err == cudaSuccess) err = cudaDriverGetVersion(&d);
  *runtime = r;
  *driver = d;
  return err;
}

KVS_API const char* kvs_cuda_error_name(int32_t code) {
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

KVS_API const char* kvs_cuda_error_string(int32_t code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

KVS_API int kvs_cuda_stream_synchronize(uint64_t stream) {
  return cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)));
}

}  // extern "C"
