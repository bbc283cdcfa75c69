// Host build of the chunk copies: the kernels' index math (kvs_index.h) with memcpy.
//
// It walks exactly the work items of a one-round CUDA launch (same unit order, same
// pieces, same access width, same skipped positions), so the tests on a machine
// without a GPU exercise the index code the kernels run. It is also a CPU copy path:
// addresses are plain host pointers, the copy is done when the call returns.
#include <stdint.h>
#include <string.h>

#include "kvs_abi.h"
#include "kvs_index.h"
#include "kvs_uuid.h"

#ifndef KVS_SOURCE_HASH
#define KVS_SOURCE_HASH "unknown"
#endif

namespace {

int copy(bool gather, const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
         int32_t num_segments, int64_t segment_stride, int64_t segment_bytes, int32_t block_outer,
         const int64_t* block_ids, int32_t blocks_per_chunk, const uint64_t* chunk_addresses,
         int64_t num_chunks) {
  if (num_chunks <= 0) return 0;
  const kvs::Geometry g{block_stride,  segment_stride,   segment_bytes, num_layers,
                        num_segments, blocks_per_chunk, block_outer};
  const int width = kvs::vector_width(g, layer_addresses, chunk_addresses, num_chunks);
  const int64_t piece_bytes = kvs::base_piece_bytes(width);
  const int64_t pieces = kvs::pieces_per_unit(g, piece_bytes);
  const int64_t num_items = num_chunks * kvs::units_per_chunk(g) * pieces;
  for (int64_t item = 0; item < num_items; ++item) {
    const kvs::Work w = kvs::work_item(g, item, pieces, piece_bytes);
    const kvs::Unit u = kvs::unit_coords(g, w.unit);
    const int64_t block = block_ids[u.chunk * blocks_per_chunk + u.position];
    if (block < 0) continue;
    char* page = reinterpret_cast<char*>(
        kvs::page_address(g, layer_addresses[u.layer], block, u.segment) + w.begin);
    char* chunk = reinterpret_cast<char*>(chunk_addresses[u.chunk] +
                                          kvs::chunk_offset(g, u.layer, u.position, u.segment) +
                                          w.begin);
    // Whole vectors only, as the kernel copies: a wrong width drops bytes here too.
    const size_t nbytes = static_cast<size_t>((w.end - w.begin) / width * width);
    if (gather) {
      memcpy(chunk, page, nbytes);
    } else {
      memcpy(page, chunk, nbytes);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

KVS_API int kvs_gather(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                       int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                       int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                       const uint64_t* chunk_addresses, int64_t num_chunks, int32_t /*max_ctas*/,
                       uint64_t /*stream*/) {
  return copy(true, layer_addresses, num_layers, block_stride, num_segments, segment_stride,
              segment_bytes, block_outer, block_ids, blocks_per_chunk, chunk_addresses,
              num_chunks);
}

KVS_API int kvs_scatter(const uint64_t* layer_addresses, int32_t num_layers, int64_t block_stride,
                        int32_t num_segments, int64_t segment_stride, int64_t segment_bytes,
                        int32_t block_outer, const int64_t* block_ids, int32_t blocks_per_chunk,
                        const uint64_t* chunk_addresses, int64_t num_chunks, int32_t /*max_ctas*/,
                        uint64_t /*stream*/) {
  return copy(false, layer_addresses, num_layers, block_stride, num_segments, segment_stride,
              segment_bytes, block_outer, block_ids, blocks_per_chunk, chunk_addresses,
              num_chunks);
}

#define KVS_BACKEND_NAME "host"
#include "kvs_common.h"

// 1 is cudaErrorInvalidValue, what the CUDA library returns for the same text.
KVS_API int kvs_uuid_parse(const char* text, uint8_t* bytes) {
  return kvs::parse_uuid(text, bytes) ? 0 : 1;
}

}  // extern "C"
