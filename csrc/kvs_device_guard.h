// Which device a runtime call of ipc mode runs on, and which one the thread keeps.
//
// Every entry point of kvs_ipc.cu names the device it works on. The sidecar sees
// every GPU of its node (NVIDIA_VISIBLE_DEVICES=all) and must create a context on
// its own vLLM's GPU only: cudaSetDevice initialises the primary context of the
// device it names (cuda_runtime_api.h, CUDA 12+), so giving a thread its "previous"
// device back is only safe where that device already has a context current on the
// thread. A fresh thread (the liveness thread, a pool thread) reports device 0
// from cudaGetDevice without any context: restoring 0 there would take ~0.5 GiB on
// another pod's GPU. So the guard switches to the target and gives the earlier
// device back only when a context was current before it switched.
//
// Header-only and free of CUDA headers: the CUDA library instantiates it over the
// runtime, and the CPU tests compile it with g++ over a recording stand-in.
#ifndef KVSTRATA_KVS_DEVICE_GUARD_H_
#define KVSTRATA_KVS_DEVICE_GUARD_H_

namespace kvs {

// Runtime must provide (0 is success for the int results):
//   int get_device(int* device);   int set_device(int device);
//   bool has_current_context();    whether the thread has a context current now
template <class Runtime>
class DeviceGuard {
 public:
  DeviceGuard(Runtime& runtime, int device) : runtime_(runtime) {
    err_ = runtime_.get_device(&previous_);
    if (err_ != 0 || previous_ == device) return;
    const bool had_context = runtime_.has_current_context();
    err_ = runtime_.set_device(device);
    restore_ = err_ == 0 && had_context;
  }
  ~DeviceGuard() {
    if (restore_) runtime_.set_device(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  int error() const { return err_; }

 private:
  Runtime& runtime_;
  int previous_ = 0;
  bool restore_ = false;
  int err_ = 0;
};

}  // namespace kvs

#endif  // KVSTRATA_KVS_DEVICE_GUARD_H_
