// GPU UUIDs as text -> the 16 bytes of cudaDeviceProp.uuid.
//
// The sidecar is told which GPU a vLLM worker's KV lives on by UUID, because device
// numbers differ between containers (CUDA_VISIBLE_DEVICES renumbers them). The text
// comes from nvidia-smi or the driver ("GPU-" + 8-4-4-4-12 hex digits), from torch
// (str(torch.cuda.get_device_properties(i).uuid): the same without the prefix), or
// from a MIG instance ("MIG-" + the same). All are accepted, in either letter case.
//
// Header-only and free of CUDA headers: the CUDA library matches devices with it and
// the host library exports it (kvs_uuid_parse) so the CPU tests check the same code.
#ifndef KVSTRATA_KVS_UUID_H_
#define KVSTRATA_KVS_UUID_H_

#include <stdint.h>

namespace kvs {

inline int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

inline bool has_prefix(const char* text, const char* prefix) {
  for (; *prefix != '\0'; ++text, ++prefix) {
    const char a = *text >= 'a' && *text <= 'z' ? static_cast<char>(*text - 'a' + 'A') : *text;
    if (a != *prefix) return false;
  }
  return true;
}

// Parse `text` into `out`; false unless it is an optional "GPU-" / "MIG-" prefix
// followed by exactly 32 hex digits and single dashes between digits, wherever they
// fall (the canonical 8-4-4-4-12 grouping, or none; no leading, trailing or double dash).
inline bool parse_uuid(const char* text, uint8_t out[16]) {
  if (text == nullptr) return false;
  if (has_prefix(text, "GPU-") || has_prefix(text, "MIG-")) text += 4;
  int digits = 0;
  bool after_dash = true;  // a dash may not come first
  for (; *text != '\0'; ++text) {
    if (*text == '-') {
      if (after_dash) return false;
      after_dash = true;
      continue;
    }
    const int v = hex_value(*text);
    if (v < 0 || digits == 32) return false;
    if (digits % 2 == 0) {
      out[digits / 2] = static_cast<uint8_t>(v << 4);
    } else {
      out[digits / 2] = static_cast<uint8_t>(out[digits / 2] | v);
    }
    ++digits;
    after_dash = false;
  }
  return digits == 32 && !after_dash;
}

}  // namespace kvs

#endif  // KVSTRATA_KVS_UUID_H_
