// The C ABI entry points that are the same in both libraries (kvs_abi.h).
// Included once, inside the extern "C" block of kvs_host.cpp and
// kvs_transfer.cu, after KVS_BACKEND_NAME is defined ("host" or "cuda").
#ifndef KVS_COMMON_H
#define KVS_COMMON_H

#ifndef KVS_BACKEND_NAME
#error "define KVS_BACKEND_NAME before including kvs_common.h"
#endif

KVS_API int kvs_vector_width(const uint64_t* layer_addresses, int32_t num_layers,
                             int64_t block_stride, int64_t segment_stride, int64_t segment_bytes,
                             const uint64_t* chunk_addresses, int64_t num_chunks) {
  const kvs::Geometry g{block_stride, segment_stride, segment_bytes, num_layers, 1, 1, 0};
  return kvs::vector_width(g, layer_addresses, chunk_addresses, num_chunks);
}

KVS_API int kvs_abi_version(void) { return KVS_ABI_VERSION; }

KVS_API const char* kvs_source_hash(void) { return KVS_SOURCE_HASH; }

KVS_API const char* kvs_backend(void) { return KVS_BACKEND_NAME; }

#endif  // KVS_COMMON_H
