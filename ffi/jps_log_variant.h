// JAX_PADSAFE_LOG_KERNELS=1: the FFI handlers print each kernel variant's name to stderr the first time
// this process launches it (which kernel family served a call: troubleshooting, A/B runs, the GPU checks).
#pragma once
#include <array>
#include <cstdio>
#include <cstdlib>
#include <mutex>

// `what` names the handler ("forward kernel", "backward kernels"); `table` is its registry, `var` an entry
// of it.  One set of seen entries per registry type (a static local per template instance).
template <typename Variant>
void JpsLogVariantOnce(const Variant *table, const Variant *var, const char *what) {
  static const bool on = [] {
    const char *e = std::getenv("JAX_PADSAFE_LOG_KERNELS");
    return e && e[0] == '1';
  }();
  if (!on) return;
  static std::mutex mu;
  static std::array<bool, 4096> seen{};
  const long idx = long(var - table);
  std::lock_guard<std::mutex> lock(mu);
  if (idx >= 0 && idx < long(seen.size()) && !seen[idx]) {
    seen[idx] = true;
    std::fprintf(stderr, "jax_padsafe: %s %s\n", what, var->name);
  }
}
