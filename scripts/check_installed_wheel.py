"""Checks an installed jax_padsafe as pip users get it: imported from site-packages, its kernel library
loaded, and (on a CUDA GPU) the forward and backward running on the kernels with padding that cannot
poison a result.

    python check_installed_wheel.py                  # on a GPU machine: every check; fails without a GPU
    python check_installed_wheel.py --lowering-only  # any machine: the checks that need no GPU

Run it with the Python of the environment the wheel is installed in, from a folder that holds no
jax_padsafe source tree (scripts/check_installed_wheel.sh sets that up). Needs only jax, numpy and
the installed jax_padsafe. Exit status 0 when every check passed, 1 otherwise.

The checks:
1. ``jax_padsafe`` is imported from the site-packages of the running environment (not from a checkout
   or an editable install), and the build-time kernel sources are not in it (the wheel excludes them).
2. ``kernels_status()``: the library loads, with forward and backward variants.
3. For every (dtype, head dim) the library was built for (softcap off): the program of a loss and its
   gradient, lowered for CUDA, calls the forward and backward kernels (``attention_backends``).
4. GPU only, for the same variants (head dims: ``--head-dims``): the jitted loss and gradient run on the
   kernels (``attention_backends`` of the program as lowered for the GPU), valid outputs are finite and
   close to the pure-JAX path in float32, and NaN written into the padded rows of Q, K, V and of the output
   cotangent gives outputs and gradients bitwise identical to zero padding, padded rows exactly zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import traceback
import warnings
from pathlib import Path

# The handlers then fill every output they do not memset with NaN before the kernels run, so a row no
# kernel writes fails the exact-zero checks instead of passing on what the allocator left (as in tests/).
os.environ.setdefault("JAX_PADSAFE_POISON_OUTPUTS", "1")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

FAILURES: list[str] = []


def check(ok: bool, what: str) -> bool:
  print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
  if not ok:
    FAILURES.append(what)
  return ok


def check_location():
  """1: the package comes from this environment's site-packages, without the build-time sources."""
  import jax_padsafe  # pylint: disable=import-outside-toplevel
  import importlib.util  # pylint: disable=import-outside-toplevel
  where = Path(jax_padsafe.__file__).resolve().parent
  site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
  print(f"jax_padsafe {jax_padsafe.__version__} from {where}")
  print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, python {sys.version.split()[0]}, "
        f"backend {jax.default_backend()}")
  check(sys.prefix != sys.base_prefix, f"running in a virtual environment ({sys.prefix})")
  check(any(where.parent == s for s in site), f"jax_padsafe imported from this environment's site-packages "
        f"({', '.join(map(str, sorted(site)))})")
  check(importlib.util.find_spec("jax_padsafe.kernels") is None,
        "the build-time kernel sources (jax_padsafe/kernels) are not installed")
  return jax_padsafe


def check_status(jax_padsafe):
  """2: the kernel library of the install loads."""
  status = jax_padsafe.kernels_status()
  print(f"kernels_status(): {status}")
  where = Path(jax_padsafe.__file__).resolve().parent
  check(status.loaded and status.reason is None, f"the kernel library is loaded (reason: {status.reason})")
  check(status.path is not None and Path(status.path).resolve().is_relative_to(where),
        "the library loaded is the one inside the installed package")
  check(status.forward_variants > 0 and status.backward_variants > 0,
        f"forward and backward variants built ({status.forward_variants}, {status.backward_variants})")
  check(jax_padsafe.kernels_available() == {"forward": True, "backward": True}, "kernels_available()")
  return status


def built_variants(head_dims):
  """``[(dtype, head_dim)]`` the library has forward and backward kernels for, softcap off."""
  from jax_padsafe._backends.cute import library  # pylint: disable=import-outside-toplevel
  both = set(library.built_variants("forward")) & set(library.built_variants("backward"))
  found = sorted({(dtype, hd) for _, dtype, hd, cap in both if not cap})
  return [(d, h) for d, h in found if head_dims is None or h in head_dims]


def make_problem(dtype, head_dim, seed=0):
  """A causal GQA batch with padding in every sequence, a query row of length 0 and a sequence with one
  key; shapes that are not multiples of any tile."""
  b, t, s, n, k = 3, 200, 301, 4, 2
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, n, head_dim))
  kv = rng.standard_normal((2, b, s, k, head_dim))
  do = rng.standard_normal((b, t, n, head_dim))
  q_len = np.array([200, 77, 0], np.int32)
  kv_len = np.array([301, 150, 1], np.int32)
  q_valid = np.arange(t)[None, :] < q_len[:, None]
  kv_valid = np.arange(s)[None, :] < kv_len[:, None]
  return dict(q=q, k=kv[0], v=kv[1], do=do, q_len=q_len, kv_len=kv_len, q_valid=q_valid,
              kv_valid=kv_valid, dtype=jnp.dtype(dtype))


def padded(x, valid, fill, dtype):
  """``x`` in ``dtype`` with every padded row (``valid[b, row]`` False) set to ``fill``."""
  return jnp.asarray(np.where(valid[:, :, None, None], x, fill), dtype)


def vjp_fn(jax_padsafe, implementation):
  def run(q, k, v, do, q_len, kv_len):
    def attend(q, k, v):
      return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                               key_value_seq_lengths=kv_len, implementation=implementation)
    out, pullback = jax.vjp(attend, q, k, v)
    return (out,) + pullback(do)
  return jax.jit(run)


def bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def check_lowering(jax_padsafe, variants):
  """3: lowered for CUDA (no GPU needed), the loss and its gradient call the forward and backward kernels."""
  for dtype, hd in variants:
    x = jax.ShapeDtypeStruct((2, 64, 4, hd), jnp.dtype(dtype))

    def loss(q, k, v):
      return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))

    where = jax_padsafe.attention_backends(jax.grad(loss, (0, 1, 2)), x, x, x, platform="cuda")
    check(where.forward and where.backward, f"{dtype} hd{hd}, lowered for CUDA: {where}")


def check_gpu(jax_padsafe, status, variants):
  """4: on the GPU, the kernels run forward and backward and padding cannot poison a result."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not check(bool(gpus), f"a CUDA GPU is visible to jax (devices: {jax.devices()})"):
    return
  cc = getattr(gpus[0], "compute_capability", None)
  print(f"GPU: {gpus[0].device_kind}, compute capability {cc}; library archs {status.archs}")
  if cc is not None:
    cc = str(cc)
    # Compiled device code runs on its own major version only (sm_80: 8.0/8.6/8.7/8.9); the "a" archs only
    # on their exact compute capability.
    runs_on = {"sm_80": cc.startswith("8."), "sm_90a": cc == "9.0", "sm_100a": cc == "10.0",
               "sm_120": cc.startswith("12.")}
    check(any(runs_on.get(a, False) for a in status.archs),
          f"the library has kernels for this GPU (built: {', '.join(status.archs)})")
  kernels, reference = vjp_fn(jax_padsafe, "cute"), vjp_fn(jax_padsafe, "xla")
  for dtype, hd in variants:
    p = make_problem(dtype, hd)
    name = f"{dtype} hd{hd}"
    lengths = (jnp.asarray(p["q_len"]), jnp.asarray(p["kv_len"]))

    def inputs(fill, p=p):
      return (padded(p["q"], p["q_valid"], fill, p["dtype"]), padded(p["k"], p["kv_valid"], fill, p["dtype"]),
              padded(p["v"], p["kv_valid"], fill, p["dtype"]), padded(p["do"], p["q_valid"], fill, p["dtype"]))

    clean, poisoned = inputs(0.0), inputs(np.nan)
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("error", jax_padsafe.KernelLibraryWarning)
        where = jax_padsafe.attention_backends(kernels, *clean, *lengths)
        check(where.forward and where.backward, f"{name}: the program as lowered for the GPU: {where}")
        got = [np.asarray(x) for x in kernels(*clean, *lengths)]
        nan = [np.asarray(x) for x in kernels(*poisoned, *lengths)]
        f32 = [x.astype(jnp.float32) for x in clean]
        ref = [np.asarray(x, np.float32) for x in reference(*f32, *lengths)]
    except Exception:  # pylint: disable=broad-except
      check(False, f"{name}: forward and backward ran on the kernels:\n{traceback.format_exc()}")
      continue
    rows = {"out": p["q_valid"], "dq": p["q_valid"], "dk": p["kv_valid"], "dv": p["kv_valid"]}
    for (what, valid), a, b, r in zip(rows.items(), got, nan, ref):
      same = np.array_equal(bits(a), bits(b))
      check(same, f"{name} {what}: NaN in the padded rows of q, k, v, dO gives bitwise the same {what} as zeros"
            + ("" if same else f" ({np.sum(bits(a) != bits(b))} elements differ)"))
      pad = a[~valid]
      check(np.array_equal(bits(pad), np.zeros_like(bits(pad))), f"{name} {what}: padded rows exactly 0")
      a32 = a.astype(np.float32)[valid]
      rel = float(np.linalg.norm(a32 - r[valid]) / max(np.linalg.norm(r[valid]), 1e-30))
      # bf16/fp16 inputs against the float32 pure-JAX path: a rounding error is below 1e-2; a wrong
      # tile, mask or scale is far above.
      check(bool(np.isfinite(a32).all()) and rel < 2e-2,
            f"{name} {what}: valid rows finite and close to the float32 pure-JAX path (relative error {rel:.1e})")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lowering-only", action="store_true",
                      help="skip the checks that run on a GPU (for machines without one)")
  parser.add_argument("--head-dims", default=None,
                      help="comma-separated head dims for the checks (default: every one the library has)")
  args = parser.parse_args(argv)
  head_dims = None if args.head_dims is None else {int(h) for h in args.head_dims.split(",")}

  jax_padsafe = check_location()
  status = check_status(jax_padsafe)
  variants = built_variants(head_dims) if status.loaded else []
  if status.loaded:
    check(bool(variants), f"variants to check: {', '.join(f'{d} hd{h}' for d, h in variants) or 'none'}")
    check_lowering(jax_padsafe, variants)
    if not args.lowering_only:
      check_gpu(jax_padsafe, status, variants)
  if FAILURES:
    print(f"\n{len(FAILURES)} check(s) FAILED:\n  " + "\n  ".join(f.splitlines()[0] for f in FAILURES))
    return 1
  print("\nall checks passed" + (" (lowering only: no GPU checks)" if args.lowering_only else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
