// The core shared by the FFI handlers (common.h), and the library's version entry point.
#include "common.h"

#include <atomic>
#include <cmath>
#include <cstdlib>

#include "jps_fwd_args.h"  // jps_note_cuda_error

namespace {

thread_local cudaError_t g_load_error = cudaSuccess;

constexpr int kMaxDevices = 64;
// Per device: 0 not queried yet, else 10 * major + minor + 1.
std::array<std::atomic<int>, kMaxDevices> g_capability_of_device{};

bool EnvIs(const char *name, char value) {
  const char *e = std::getenv(name);
  return e && e[0] == value;
}

}  // namespace

void jps_note_cuda_error(cudaError_t err) {
  if (err != cudaSuccess && g_load_error == cudaSuccess) g_load_error = err;
}

namespace jps {

ffi::Error InvalidArgument(const char *target, const std::string &msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

ffi::Error CudaError(const char *target, const std::string &what, cudaError_t err) {
  return ffi::Error::Internal(std::string(target) + ": " + what + ": " + cudaGetErrorString(err));
}

int ArchForCapability(int major, int minor) {
  switch (major) {
    case 8: return 80;
    case 9: return minor == 0 ? 90 : -1;
    case 10: return 100;
    case 12: return 120;
    default: return -1;
  }
}

ffi::Error CurrentCapability(const char *target, DeviceCapability *cap) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return CudaError(target, "cudaGetDevice", e);
  if (device < 0 || device >= kMaxDevices)
    return ffi::Error::Internal(std::string(target) + ": device index " + std::to_string(device) + " out of range");
  int packed = g_capability_of_device[device].load();
  if (packed == 0) {
    int major = 0, minor = 0;
    cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (e != cudaSuccess) return CudaError(target, "cudaDeviceGetAttribute", e);
    packed = 10 * major + minor + 1;
    g_capability_of_device[device].store(packed);
  }
  cap->major = (packed - 1) / 10;
  cap->minor = (packed - 1) % 10;
  cap->arch = ArchForCapability(cap->major, cap->minor);
  return ffi::Error::Success();
}

ffi::Error NoKernelsForDevice(const char *target, const char *what, const DeviceCapability &cap) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string(target) + ": no " + what + " kernels were built for compute capability " +
                        std::to_string(cap.major) + "." + std::to_string(cap.minor) +
                        " (rebuild with JPS_ARCHS including it)");
}

bool Sm90FamilyEnabled() {
  static const bool enabled = !EnvIs("JAX_PADSAFE_SM90", '0');
  return enabled;
}

cudaError_t TakeLoadError() {
  const cudaError_t err = g_load_error;
  g_load_error = cudaSuccess;
  return err;
}

bool HasShape(ffi::Span<const int64_t> dims, int64_t d0, int64_t d1, int64_t d2) {
  return dims.size() == 3 && dims[0] == d0 && dims[1] == d1 && dims[2] == d2;
}

bool HasShape(ffi::Span<const int64_t> dims, int64_t d0, int64_t d1) {
  return dims.size() == 2 && dims[0] == d0 && dims[1] == d1;
}

ffi::Error CheckProblem(const char *target, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                        const ffi::Buffer<ffi::S32> &cu_q, const ffi::Buffer<ffi::S32> &cu_k,
                        const ffi::Buffer<ffi::S32> &used_q, const ffi::Buffer<ffi::S32> &used_k, float scale,
                        float softcap, int32_t max_seqlen_q, int32_t max_seqlen_k, Problem *p) {
  auto invalid = [target](const char *msg) { return InvalidArgument(target, msg); };
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3) return invalid("expected q, k and v of rank 3");
  p->total_q = qd[0];
  p->num_heads = qd[1];
  p->head_dim = qd[2];
  p->total_k = kd[0];
  p->num_kv_heads = kd[1];
  if (!HasShape(kd, p->total_k, p->num_kv_heads, p->head_dim) ||
      !HasShape(v.dimensions(), p->total_k, p->num_kv_heads, p->head_dim))
    return invalid("k and v must be [total_k, K, H] with q's H");
  if (p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0)
    return invalid("num_heads must be a positive multiple of num_kv_heads");
  const ffi::DataType et = q.element_type();
  if (k.element_type() != et || v.element_type() != et) return invalid("q, k and v must share one dtype");
  if (et == ffi::DataType::BF16) p->dtype = 0;
  else if (et == ffi::DataType::F16) p->dtype = 1;
  else return invalid("dtype must be bfloat16 or float16");
  p->batch = int64_t(used_q.element_count());
  if (int64_t(cu_q.element_count()) != p->batch + 1 || int64_t(cu_k.element_count()) != p->batch + 1 ||
      int64_t(used_k.element_count()) != p->batch)
    return invalid("cu_seqlens_q/k must have batch+1 entries and seqused_q/k batch entries");
  if (p->total_q >= (int64_t(1) << 30) || p->total_k >= (int64_t(1) << 30) || max_seqlen_q < 0 || max_seqlen_k < 0)
    return invalid("lengths must be below 2**30");
  if (p->num_heads > 65535 || p->batch > 65535) return invalid("num_heads and batch must be at most 65535");
  if (!(scale > 0.0f) || std::isinf(scale) || !(softcap >= 0.0f) || std::isinf(softcap))
    return invalid("scale must be finite and > 0, softcap finite and >= 0");
  p->softcap = softcap > 0.0f ? 1 : 0;
  return ffi::Error::Success();
}

ffi::Error NoVariant(const char *target, const char *what, const Problem &p, int arch, const std::string &built_dims,
                     bool excluded) {
  const std::string call = "head_dim " + std::to_string(p.head_dim) + ", dtype " + (p.dtype ? "float16" : "bfloat16") +
                           ", softcap " + std::to_string(p.softcap) + (p.aux == 1 ? ", with a mask tensor" : p.aux == 2 ? ", with a bias tensor" : "") +
                           " on sm_" + std::to_string(arch);
  std::string msg = std::string(target) + ": no " + what + " kernel ";
  if (excluded)
    msg += "may serve " + call + ": its only variants are the Hopper family's, excluded by JAX_PADSAFE_SM90=0 or " +
           "(forward) by its grid limit of 2**31 tiles";
  else
    msg += "was built for " + call + " (head dims built for that dtype and softcap: " +
           (built_dims.empty() ? std::string("none") : built_dims) +
           "; rebuild with JPS_HEAD_DIMS, JPS_DTYPES, JPS_SOFTCAP and JPS_AUX including it)";
  return ffi::Error(ffi::ErrorCode::kUnimplemented, msg);
}

bool CompactScheduleMayRun(int64_t total, int32_t max_seqlen, int64_t block, int64_t batch) {
  return block > 0 && 2 * (total / block + batch) <= (int64_t(max_seqlen) + block - 1) / block * batch;
}

ffi::Error Zero(const char *target, cudaStream_t stream, void *p, size_t bytes) {
  if (cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream); err != cudaSuccess) return CudaError(target, "memset", err);
  return ffi::Error::Success();
}

OutputZeroing ChooseOutputZeroing(int family, bool rows_covered, int arch) {
  if (family != 1) return OutputZeroing::kMemset;
  if (rows_covered) return OutputZeroing::kTilesCoverRows;
  return ZeroRowsAvailable(arch) ? OutputZeroing::kZeroUncoveredRows : OutputZeroing::kMemset;
}

ffi::Error Poison(const char *target, cudaStream_t stream, void *p, size_t bytes) {
  static const bool enabled = EnvIs("JAX_PADSAFE_POISON_OUTPUTS", '1');
  if (!enabled) return ffi::Error::Success();
  if (cudaError_t err = cudaMemsetAsync(p, 0xFF, bytes, stream); err != cudaSuccess) return CudaError(target, "poison", err);
  return ffi::Error::Success();
}

}  // namespace jps

// The XLA FFI API version the handlers were compiled against (the oldest supported jaxlib's).
JPS_EXPORT int jps_ffi_api_version(int *major, int *minor) {
  *major = XLA_FFI_API_MAJOR;
  *minor = XLA_FFI_API_MINOR;
  return 0;
}
