// Index math of the chunk copies, shared by the CUDA kernels and the host build.
//
// The byte model is kvstrata.sidecar.transfer.plan.CopyPlan's (sidecar/transfer/plan.py):
// unit (layer l, block b, segment s) is `segment_bytes` contiguous bytes at
//     layer_addresses[l] + b * block_stride + s * segment_stride
// and a chunk of P blocks stores its units in the order
//     layer-outer: unit k = (l * P + p) * S + s      block-outer: k = (p * L + l) * S + s
// at byte offset k * segment_bytes, p being the block's position in the chunk.
//
// A copy of C chunks enumerates units chunk-major (unit u = c * L * P * S + k), so
// consecutive units write consecutive chunk bytes. Each unit is cut into pieces of
// at most `piece_bytes`; a work item is one piece of one unit. The CUDA kernel hands
// work items to thread blocks; the host build walks the same items with memcpy, so
// the tests on a machine without a GPU run this exact code.
//
// Everything here is inline and free of CUDA and torch headers: nvcc compiles it for
// host and device (KVS_HD), g++ for the host only.
#ifndef KVSTRATA_KVS_INDEX_H_
#define KVSTRATA_KVS_INDEX_H_

#include <stdint.h>

#if defined(__CUDACC__)
#define KVS_HD __host__ __device__ __forceinline__
#else
#define KVS_HD inline
#endif

namespace kvs {

// The scalars of a CopyPlan plus the chunk size of one call.
struct Geometry {
  int64_t block_stride;    // bytes from block b to block b + 1 of one layer
  int64_t segment_stride;  // bytes from segment s to s + 1 of one page (0 when S == 1)
  int64_t segment_bytes;   // contiguous bytes of one unit (> 0)
  int32_t num_layers;      // L >= 1
  int32_t num_segments;    // S >= 1
  int32_t blocks_per_chunk;  // P >= 1
  int32_t block_outer;     // chunk order: 0 layer-outer, 1 block-outer
};

// Where one unit of a call sits.
struct Unit {
  int64_t chunk;     // chunk index in the call
  int32_t position;  // block position p in the chunk
  int32_t layer;
  int32_t segment;
};

// One work item: bytes [begin, end) of unit `unit`.
struct Work {
  int64_t unit;
  int64_t begin;
  int64_t end;
};

// Threads per CUDA block and vector loads in flight per thread: a piece of a unit is
// copied in rounds of kThreads * kUnroll vectors. The host build cuts units at the
// same base piece size so it walks the same work items as a one-round launch.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

KVS_HD int64_t base_piece_bytes(int width) { return static_cast<int64_t>(kThreads) * kUnroll * width; }

KVS_HD int64_t units_per_chunk(const Geometry& g) {
  return static_cast<int64_t>(g.blocks_per_chunk) * g.num_layers * g.num_segments;
}

// Unit index in the call -> (chunk, position, layer, segment).
KVS_HD Unit unit_coords(const Geometry& g, int64_t unit) {
  const int64_t per_chunk = units_per_chunk(g);
  Unit u;
  u.chunk = unit / per_chunk;
  int64_t k = unit - u.chunk * per_chunk;  // unit index inside the chunk
  u.segment = static_cast<int32_t>(k % g.num_segments);
  k /= g.num_segments;
  if (g.block_outer) {
    u.layer = static_cast<int32_t>(k % g.num_layers);
    u.position = static_cast<int32_t>(k / g.num_layers);
  } else {
    u.position = static_cast<int32_t>(k % g.blocks_per_chunk);
    u.layer = static_cast<int32_t>(k / g.blocks_per_chunk);
  }
  return u;
}

// Byte offset of a unit inside its chunk (CopyPlan.chunk_offset).
KVS_HD int64_t chunk_offset(const Geometry& g, int32_t layer, int32_t position, int32_t segment) {
  const int64_t k =
      g.block_outer
          ? (static_cast<int64_t>(position) * g.num_layers + layer) * g.num_segments + segment
          : (static_cast<int64_t>(layer) * g.blocks_per_chunk + position) * g.num_segments +
                segment;
  return k * g.segment_bytes;
}

// Byte address of a unit in the paged KV (CopyPlan.source_address). Unsigned
// arithmetic: a signed overflow would be undefined, a wrapped address is not.
KVS_HD uint64_t page_address(const Geometry& g, uint64_t layer_address, int64_t block_id,
                             int32_t segment) {
  return layer_address + static_cast<uint64_t>(block_id) * static_cast<uint64_t>(g.block_stride) +
         static_cast<uint64_t>(segment) * static_cast<uint64_t>(g.segment_stride);
}

KVS_HD int64_t pieces_per_unit(const Geometry& g, int64_t piece_bytes) {
  return (g.segment_bytes + piece_bytes - 1) / piece_bytes;
}

// Work item index -> (unit, byte range); `pieces` is pieces_per_unit(g, piece_bytes).
KVS_HD Work work_item(const Geometry& g, int64_t item, int64_t pieces, int64_t piece_bytes) {
  Work w;
  w.unit = item / pieces;
  w.begin = (item - w.unit * pieces) * piece_bytes;
  const int64_t end = w.begin + piece_bytes;
  w.end = end < g.segment_bytes ? end : g.segment_bytes;
  return w;
}

// The widest access (16, 8, 4, 2 or 1 bytes) that every address of the call keeps
// aligned: each unit's page and chunk address is a sum of these terms (block ids and
// segment indices only multiply strides, chunk offsets are multiples of
// segment_bytes), and a unit's length is segment_bytes. Chosen once per launch.
KVS_HD int vector_width(const Geometry& g, const uint64_t* layer_addresses,
                        const uint64_t* chunk_addresses, int64_t num_chunks) {
  uint64_t bits = static_cast<uint64_t>(g.block_stride) | static_cast<uint64_t>(g.segment_stride) |
                  static_cast<uint64_t>(g.segment_bytes);
  for (int32_t l = 0; l < g.num_layers; ++l) bits |= layer_addresses[l];
  for (int64_t c = 0; c < num_chunks; ++c) bits |= chunk_addresses[c];
  int width = 16;
  while (width > 1 && (bits & static_cast<uint64_t>(width - 1)) != 0) width /= 2;
  return width;
}

}  // namespace kvs

#endif  // KVSTRATA_KVS_INDEX_H_
