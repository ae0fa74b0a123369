"""Backend dispatch, checked on the CPU by lowering for CUDA: which calls reach the kernels'
custom call, which fall back to the pure-JAX path, and which raise."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jax_padsafe
from jax_padsafe import _backends
from jax_padsafe._backends.cute import library
from jax_padsafe._core.spec import AttentionSpec
TARGET = "jax_padsafe_fwd"
AUX_TARGET = "jax_padsafe_fwd_aux"


def _qkv(b=2, t=16, s=24, n=8, k=2, h=64, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((b, t, n, h), dtype), jax.ShapeDtypeStruct((b, s, k, h), dtype),
          jax.ShapeDtypeStruct((b, s, k, h), dtype))


def _lowered(f, *args, platform="cuda"):
  return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _targets(text):
  return re.findall(r"stablehlo\.custom_call @(\w+)", text)


def test_cute_forward_lowers_to_custom_call(kernels_built):
  lens = jnp.array([16, 5], jnp.int32)
  f = lambda q, k, v: jax_padsafe.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=lens, implementation="cute")
  assert _targets(_lowered(f, *_qkv())).count(TARGET) == 1
  # On the CPU the same program lowers to the pure-JAX path.
  assert TARGET not in _lowered(f, *_qkv(), platform="cpu")


def test_default_prefers_kernels_and_gradient_keeps_them(kernels_built):
  def loss(q, k, v):
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
  assert TARGET in _targets(_lowered(loss, *_qkv()))
  grad_targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *_qkv()))
  assert TARGET in grad_targets and "jax_padsafe_bwd" in grad_targets


def _rows_covered(text):
  return [int(x) for x in re.findall(r"rows_covered = (\d+) : i32", text)]


def test_lengths_path_promises_covered_rows_and_skips_input_sanitising(kernels_built):
  """The lengths path (dense [B, T] slots) tells both kernels rows_covered=1, so the sm90 kernels' own
  zero rows replace the output memsets; and no select pass over q/k/v/dq/dk/dv surrounds the calls (the
  kernels never compute from padded rows; the pure-JAX path keeps its sanitising select)."""
  lens = jnp.array([16, 5], jnp.int32)

  def loss(q, k, v):
    o = jax_padsafe.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lens,
                                          key_value_seq_lengths=jnp.array([24, 3], jnp.int32))
    return jnp.sum(o.astype(jnp.float32))

  text = _lowered(jax.grad(loss, (0, 1, 2)), *_qkv())
  assert _targets(text) == [TARGET, "jax_padsafe_bwd"]
  assert _rows_covered(text) == [1, 1]
  assert re.findall(r"partial_keys = (\d+) : i32", text) == ["0"]  # every key of each row: dQ shifted
  big_selects = re.findall(r"stablehlo\.select .*tensor<2x(?:16|24)x\d+x64xi1>", text)
  assert not big_selects
  assert re.findall(r"stablehlo\.select", _lowered(jax.grad(loss, (0, 1, 2)), *_qkv(), platform="cpu"))


def test_gapped_layouts_are_not_promised_covered(kernels_built):
  """Packed varlen rows (a tail past cu_seqlens[-1] is allowed) and segment-id runs (gaps between runs)
  are not covered by the kernels' tiles: rows_covered=0, so the handler zeroes the rows no tile writes
  first (a memset, or on Hopper the row-zeroing kernel, ffi/jps_zero_rows.h)."""
  q = jax.ShapeDtypeStruct((40, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((40, 2, 64), jnp.bfloat16)
  cu = jnp.array([0, 10, 31], jnp.int32)
  f = lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, cu, cu, max_seqlen_q=21, max_seqlen_k=21,
                                                   is_causal=True)
  assert _rows_covered(_lowered(f, q, kv, kv)) == [0]
  seg = jnp.array([[0] * 6 + [1] * 6 + [-1] * 4, [0] * 16], jnp.int32)
  kseg = jnp.array([[0] * 10 + [1] * 10 + [-1] * 4, [0] * 24], jnp.int32)
  g = lambda q, k, v: jax_padsafe.dot_product_attention(
      q, k, v, query_segment_ids=seg, key_value_segment_ids=kseg)
  text = _lowered(g, *_qkv())
  assert TARGET in _targets(text) and _rows_covered(text) == [0]


@pytest.mark.parametrize("h", [192, 256])
def test_backward_large_head_dims_reach_kernels(kernels_built, h):
  """Head dims 192 and 256 have backward kernels (two dK/dV passes) in the default build."""
  def loss(q, k, v):
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
  grad_targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *_qkv(h=h)))
  assert TARGET in grad_targets and "jax_padsafe_bwd" in grad_targets


@pytest.mark.parametrize("h,width", [(88, 96), (72, 80), (40, 64), (8, 64), (136, 192), (200, 256)])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_head_dims_between_built_ones_run_zero_padded(kernels_built, h, width, masked):
  """A head dim without a compiled kernel runs on the next wider one, forward and backward, with q, k, v
  (and o, dO in the backward) zero-padded to it: the kernel calls see the compiled width and the results
  come back at the call's head dim."""
  lens = jnp.array([16, 5], jnp.int32)
  mask = jnp.tril(jnp.ones((16, 24), bool))[None, None] if masked else None

  def loss(q, k, v):
    o = jax_padsafe.dot_product_attention(q, k, v, mask=mask, query_seq_lengths=lens, implementation="cute")
    assert o.shape == q.shape
    return jnp.sum(o.astype(jnp.float32))

  text = _lowered(jax.grad(loss, (0, 1, 2)), *_qkv(h=h))
  fwd, bwd = (AUX_TARGET, "jax_padsafe_bwd_aux") if masked else (TARGET, "jax_padsafe_bwd")
  assert fwd in _targets(text) and bwd in _targets(text)
  calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_padsafe" in line]
  assert all(f"x{width}xbf16>" in line and f"x{h}xbf16>" not in line for line in calls), calls
  out = jax.eval_shape(jax.grad(loss, (0, 1, 2)), *_qkv(h=h))
  assert [x.shape[-1] for x in out] == [h, h, h]


def test_backward_without_kernel_variant_uses_pure_jax(kernels_built, monkeypatch):
  """A library built without the backward variant of a head dim (here: a build restricted to hd64/128,
  as JPS_HEAD_DIMS=64,128 gives) keeps the forward kernel for hd192 but runs its gradient on the
  pure-JAX backward; with implementation="cute" as well (the backward has no NotImplementedError path)."""
  restricted = tuple((90, 0, h, c) for h in (64, 128) for c in (0, 1))  # (arch, dtype code, head dim, softcap)
  monkeypatch.setattr(library, "_load", functools.lru_cache(maxsize=None)(
      lambda: library.Loaded(None, None, restricted)))
  assert "head dim 192" in library.unsupported_reason(dtype=jnp.bfloat16, head_dim=192, num_heads=8, num_kv_heads=2,
                                                      causal=True, window=False, softcap=None, direction="backward")
  for impl in (None, "cute"):
    def loss(q, k, v):
      return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
                     .astype(jnp.float32))
    # Shapes no other test uses: traced implementations are cached per shape, and the unrestricted
    # library of the other tests sends hd192 gradients to the kernel.
    grad_targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *_qkv(t=11, s=13, h=192)))
    assert TARGET in grad_targets and "jax_padsafe_bwd" not in grad_targets
    # The variants the restricted library has still reach the backward kernel.
    assert "jax_padsafe_bwd" in _targets(_lowered(jax.grad(loss, (0, 1, 2)), *_qkv(t=11, s=13, h=128)))


def test_varlen_lowers_to_custom_call(kernels_built):
  q = jax.ShapeDtypeStruct((40, 8, 128), jnp.float16)
  k = jax.ShapeDtypeStruct((50, 2, 128), jnp.float16)
  cu = jnp.array([0, 10, 40], jnp.int32)
  cuk = jnp.array([0, 25, 50], jnp.int32)
  f = lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, cu, cuk, max_seqlen_q=30,
                                                   max_seqlen_k=25, implementation="cute")
  assert _targets(_lowered(f, q, k, k)).count(TARGET) == 1


@pytest.mark.parametrize("case", ["mask_with_segment_ids", "bias_of_other_dtype", "mask_with_softcap",
                                  "bias_per_query_only", "float32", "noncontiguous_segment_ids",
                                  "head_dim_264"])
def test_unsupported_falls_back_or_raises(kernels_built, case):
  q, k, v = _qkv(h=264 if case == "head_dim_264" else 64,
                 dtype=jnp.float32 if case == "float32" else jnp.bfloat16)
  kw = {}
  if case in ("mask_with_segment_ids", "mask_with_softcap"):
    kw["mask"] = jnp.ones((1, 1, 16, 24), bool)
  if case == "mask_with_segment_ids":
    kw["query_segment_ids"] = jnp.zeros((2, 16), jnp.int32)
    kw["key_value_segment_ids"] = jnp.zeros((2, 24), jnp.int32)
  if case == "mask_with_softcap":
    kw["softcap"] = 20.0
  if case == "bias_of_other_dtype":  # q bf16: the kernels take a bf16 or float32 bias
    kw["bias"] = jnp.zeros((1, 1, 16, 24), jnp.float16)
  if case == "bias_per_query_only":  # one bias per query row: the kernels read it per key
    kw["bias"] = jnp.zeros((1, 1, 16, 1), jnp.float32)
  if case == "noncontiguous_segment_ids":  # id 0 comes back after id 1: not one run
    kw["query_segment_ids"] = jnp.array([[0] * 5 + [1] * 5 + [0] * 6] * 2, jnp.int32)
    kw["key_value_segment_ids"] = jnp.zeros((2, 24), jnp.int32)
  default = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, **kw)
  targets = _targets(_lowered(default, q, k, v))
  assert TARGET not in targets and AUX_TARGET not in targets
  with pytest.raises(NotImplementedError, match='implementation="cute"'):
    _lowered(lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation="cute", **kw),
             q, k, v)


@pytest.mark.parametrize("feature", ["sinks", "alibi", "value_head_dim"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_features_reach_the_kernels(kernels_built, feature, layout):
  """Sinks (every layout) and a value head dim of its own (run at the next compiled width) reach the plain
  kernels forward and backward; ALiBi slopes the aux kernels on the padded layout, and the pure-JAX path on
  the packed one (implementation="cute" raises there, naming the layout)."""
  q, k, v = _qkv()
  kw = {}
  if feature == "sinks":
    kw["sinks"] = jnp.zeros((8,), jnp.float32)
  if feature == "alibi":
    kw["alibi_slopes"] = jnp.ones((8,), jnp.float32)
  if feature == "value_head_dim":  # (192, 128), DeepSeek's MLA
    q, k, _ = _qkv(h=192)
    v = jax.ShapeDtypeStruct(k.shape[:-1] + (128,), k.dtype)

  def call(impl):
    if layout == "padded":
      return lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation=impl, **kw)
    cu = jnp.array([0, 10, 16], jnp.int32)
    cuk = jnp.array([0, 20, 24], jnp.int32)
    return lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], cu, cuk, implementation=impl, **kw)

  loss = lambda q, k, v: jnp.sum(call(None)(q, k, v).astype(jnp.float32))  # noqa: E731
  targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), q, k, v))
  if feature == "alibi" and layout == "packed":
    assert not targets
    with pytest.raises(NotImplementedError, match="padded layout with lengths"):
      _lowered(call("cute"), q, k, v)
    return
  want = [AUX_TARGET, "jax_padsafe_bwd_aux"] if feature == "alibi" else [TARGET, "jax_padsafe_bwd"]
  assert targets == want
  if feature == "value_head_dim":
    text = _lowered(jax.grad(loss, (0, 1, 2)), q, k, v)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_padsafe" in line]
    assert all("x128xbf16>" not in line for line in calls), calls  # V runs at 192, zero-padded


def _forward_operands(text, target):
  """The operand types of each forward custom call to ``target``."""
  return [ops.split(", ") for ops in re.findall(
      rf"stablehlo\.custom_call @{target}\(.*?\) \{{.*?\}} : \((.*?)\) ->", text)]


@pytest.mark.parametrize("case", ["plain_padded", "plain_packed", "mask", "decode"])
def test_sinks_are_joined_in_the_forward_kernels(kernels_built, case):
  """The sinks travel into the forward kernels (one float32 per query head, joined in their epilogue; no pass
  over O afterwards): the plain and aux targets take them, on both layouts. Decoding's split-key rewrite runs
  chunks that see part of each row: its kernels take no sinks ([0]), which join after the merge."""
  # 64 rows of 4 query heads per key/value head: more than a tile, so no decoding rewrite but for "decode".
  t = 1 if case == "decode" else 64
  s = 4096 if case == "decode" else 80
  q, k, v = _qkv(t=t, s=s)
  sinks = jnp.zeros((8,), jnp.float32)
  kw = dict(sinks=sinks, implementation="cute")
  if case == "mask":
    kw["mask"] = jnp.tril(jnp.ones((t, s), bool))[None, None]
  if case == "plain_packed":
    cu, cuk = jnp.array([0, 10, 64], jnp.int32), jnp.array([0, 20, 80], jnp.int32)
    f = lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], cu, cuk, **kw)  # noqa: E731
  else:
    f = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, **kw)  # noqa: E731
  text = _lowered(f, q, k, v)
  calls = _forward_operands(text, AUX_TARGET if case == "mask" else TARGET)
  assert len(calls) == 1, text
  want = "tensor<0xf32>" if case == "decode" else "tensor<8xf32>"
  assert want in calls[0], calls[0]
  # The forward with its sinks joined is all there is, but for the split rewrite's merge.
  if case != "decode":
    assert "exponential" not in text.split("custom_call")[-1], "a pass over O after the kernels"


@pytest.mark.parametrize("case", ["causal_padding_mask", "bias_f32", "bias_bf16_per_head", "mask_and_bias",
                                  "bias_f32_mqa"])
def test_mask_and_bias_lower_to_the_aux_kernels(kernels_built, case):
  """Masks and biases of the padded layout go to the aux targets, forward and backward; dbias comes from
  the bias gradient target only when the bias is differentiated (from the pure-JAX backward for a bias
  broadcast over queries).  With one key/value head (MQA) the dbias call's sharding rule once named the
  summed query heads twice, which Shardy refused at trace time."""
  q, k, v = _qkv(h=64, n=3, k=1) if case.endswith("_mqa") else _qkv(h=64)
  kw = {}
  if case in ("causal_padding_mask", "mask_and_bias"):
    kw["mask"] = jnp.tril(jnp.ones((16, 24), bool))[None, None] & (jnp.arange(24) < 20)[None, None, None]
  if case in ("bias_f32", "mask_and_bias", "bias_f32_mqa"):
    kw["bias"] = jnp.zeros((1, 1, 16, 24), jnp.float32)
  if case == "bias_bf16_per_head":
    kw["bias"] = jnp.zeros((2, q.shape[2], 1, 24), jnp.bfloat16)
  f = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation="cute", **kw)
  targets = _targets(_lowered(f, q, k, v))
  assert targets.count(AUX_TARGET) == 1 and TARGET not in targets
  loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
  grad_targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), q, k, v))
  assert "jax_padsafe_bwd_aux" in grad_targets and "jax_padsafe_bwd" not in grad_targets
  assert "jax_padsafe_bwd_dbias" not in grad_targets
  if "bias" in kw:
    bias = kw.pop("bias")
    loss_b = lambda q, k, v, bias: jax_padsafe.dot_product_attention(
        q, k, v, bias, implementation="cute", **kw).astype(jnp.float32).sum()
    grads = _targets(_lowered(jax.grad(loss_b, (0, 1, 2, 3)), q, k, v, bias))
    per_query = bias.shape[2] == q.shape[1]
    assert grads.count("jax_padsafe_bwd_dbias") == int(per_query) and "jax_padsafe_bwd_aux" in grads


def test_xla_never_uses_kernels(kernels_built):
  f = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation="xla")
  assert TARGET not in _targets(_lowered(f, *_qkv()))


def test_without_library_default_is_pure_jax(monkeypatch):
  monkeypatch.setattr(library, "library_available", lambda: False)
  f = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v)
  assert TARGET not in _targets(_lowered(f, *_qkv()))
  assert "not built" in _backends.kernel_unsupported_reason(
      AttentionSpec(scale=1.0), *_qkv()[:2], bias=None, mask=None)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_vmap_and_grad_of_kernel_path_lower(kernels_built, layout):
  """jax.vmap over the kernel path (custom_partitioning has no batching rule of its own)."""
  if layout == "padded":
    lens = jnp.array([16, 5], jnp.int32)
    f = lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lens, implementation="cute")
    args = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in _qkv()]
  else:
    cu = jnp.array([0, 10, 40], jnp.int32)
    f = lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, cu, cu, max_seqlen_q=30,
                                                     max_seqlen_k=30, implementation="cute")
    args = [jax.ShapeDtypeStruct((3, 40, 8, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((3, 40, 2, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((3, 40, 2, 64), jnp.bfloat16)]
  assert TARGET in _targets(_lowered(jax.vmap(f), *args))
  loss = lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v).astype(jnp.float32))
  grad_targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *args))
  assert TARGET in grad_targets and "jax_padsafe_bwd" in grad_targets


def _seg_loss(kw):
  def loss(q, k, v, *ids):
    if ids:
      kw.update(query_segment_ids=ids[0], key_value_segment_ids=ids[1])
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, **kw).astype(jnp.float32))
  return loss


@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_segment_ids_run_on_kernels(kernels_built, causal):
  """Packed sequences (contiguous runs of one id, -1 padding) reach both kernels, without any
  run-time fallback when the ids are concrete."""
  ids = jnp.array([[0] * 6 + [1] * 7 + [-1] * 3, [4] * 16], jnp.int32)
  kw = dict(query_segment_ids=ids, key_value_segment_ids=ids, is_causal=causal,
            implementation="cute")
  q, _, _ = _qkv()
  kv = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)
  text = _lowered(jax.grad(_seg_loss(dict(kw)), (0, 1, 2)), q, kv, kv)
  targets = _targets(text)
  assert TARGET in targets and "jax_padsafe_bwd" in targets
  assert _branches(text) == _branches(_lengths_grad_text())


def _branches(text):
  return text.count("stablehlo.case") + text.count("stablehlo.if")


def _lengths_grad_text():
  lens = jnp.array([13, 16], jnp.int32)
  q, _, _ = _qkv()
  kv = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)
  return _lowered(jax.grad(_seg_loss(dict(query_seq_lengths=lens, implementation="cute")),
                           (0, 1, 2)), q, kv, kv)


def test_traced_segment_ids_choose_at_run_time(kernels_built):
  """Traced ids cannot be checked while tracing: the kernels and the pure-JAX path are both
  compiled and a run-time predicate (contiguous runs) picks one."""
  q, k, v = _qkv()
  ids_q = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  ids_k = jax.ShapeDtypeStruct((2, 24), jnp.int32)
  text = _lowered(jax.grad(_seg_loss(dict(is_causal=False)), (0, 1, 2)), q, k, v, ids_q, ids_k)
  targets = _targets(text)
  assert TARGET in targets and "jax_padsafe_bwd" in targets
  assert _branches(text) > _branches(_lengths_grad_text())


def test_cross_attention_segments_need_matching_positions_when_causal(kernels_built):
  """Same ids but different run starts on the two sides: fine without masks, not with causal
  (the kernels count positions from each run's start)."""
  q_ids = jnp.array([[0] * 8 + [1] * 8] * 2, jnp.int32)
  k_ids = jnp.array([[0] * 4 + [1] * 20] * 2, jnp.int32)
  q, k, v = _qkv()
  for causal, ok in ((False, True), (True, False)):
    f = lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, query_segment_ids=q_ids, key_value_segment_ids=k_ids, is_causal=causal)
    assert (TARGET in _targets(_lowered(f, q, k, v))) == ok


@pytest.mark.parametrize("causal", [False, True])
def test_ring_chunk_pairs_lower_to_kernels(kernels_built, causal):
  """Ring attention on bf16 lowers its chunk pairs to both kernels for CUDA (with the pure-JAX
  block as the run-time alternative for pairs the kernels cannot express); "xla" never does."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jax_padsafe import sharding  # pylint: disable=g-import-not-at-top
  kinds = getattr(jax.sharding, "AxisType", None)
  mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2],
                       **({"axis_types": (kinds.Auto,)} if kinds else {}))
  x = jax.ShapeDtypeStruct((2, 32, 4, 64), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, P(None, "seq")))

  def loss(impl):
    return lambda q, k, v: jnp.sum(sharding.ring_attention(
        q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, implementation=impl,
        layout="zigzag" if causal else "contiguous").astype(jnp.float32))

  targets = _targets(_lowered(jax.grad(loss(None), (0, 1, 2)), x, x, x))
  assert TARGET in targets and "jax_padsafe_bwd" in targets
  assert not _targets(_lowered(jax.grad(loss("xla"), (0, 1, 2)), x, x, x))

  # Lengths only: the grouped plan. Causal zigzag on 2 devices is 3 kernel calls per pass (step 0:
  # both diagonals in one causal call, one wholly visible pair; step 1: one call), non-causal one
  # per step; no per-pair routing (its sort) and no per-pair alternatives.
  lens = jnp.array([32, 19], jnp.int32)
  text = _lowered(jax.grad(lambda q, k, v: jnp.sum(sharding.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, query_seq_lengths=lens,
      key_value_seq_lengths=lens, layout="zigzag" if causal else "contiguous").astype(jnp.float32)),
      (0, 1, 2)), x, x, x)
  calls = 3 if causal else 2
  assert text.count(f"@{TARGET}") == calls and text.count("@jax_padsafe_bwd") == calls
  assert "stablehlo.sort" not in text
  # Each pair's keys are one block of each row's softmax: the dQ kernel's reference-key shift is off.
  assert re.findall(r"partial_keys = (\d+) : i32", text) == ["1"] * calls
  # Segment ids keep the per-pair path: a run-time route per pair, two kernel alternatives each.
  ids = jnp.zeros((2, 32), jnp.int32)
  text = _lowered(lambda q, k, v: sharding.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, query_segment_ids=ids,
      key_value_segment_ids=ids, layout="zigzag" if causal else "contiguous"), x, x, x)
  assert text.count(f"@{TARGET}") > calls and "stablehlo.sort" in text
  with pytest.raises(NotImplementedError, match="window"):
    _lowered(lambda q, k, v: sharding.ring_attention(
        q, k, v, mesh=mesh, axis_name="seq", local_window_size=4, implementation="cute"), x, x, x)
  # Sinks join after the ring: the chunk pairs still run on the kernels.
  sinks = jnp.zeros((4,), jnp.float32)
  text = _lowered(jax.grad(lambda q, k, v, sinks: jnp.sum(sharding.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, query_seq_lengths=lens,
      key_value_seq_lengths=lens, layout="zigzag" if causal else "contiguous", sinks=sinks,
      implementation="cute").astype(jnp.float32)), (0, 1, 2, 3)), x, x, x, sinks)
  assert text.count(f"@{TARGET}") == calls and text.count("@jax_padsafe_bwd") == calls


def test_max_segments_bounds_the_kernel_runs(kernels_built):
  """Three packed documents per row: max_segments=4 sizes the kernels for them; max_segments=2
  cannot hold them, so the call takes the pure-JAX path (and "cute" says why); bad values raise."""
  ids = jnp.array([[0] * 5 + [1] * 5 + [2] * 6] * 2, jnp.int32)
  q, _, _ = _qkv()
  kv = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)

  def f(max_segments, impl=None):
    return lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, query_segment_ids=ids, key_value_segment_ids=ids, is_causal=True,
        max_segments=max_segments, implementation=impl)

  assert TARGET in _targets(_lowered(f(4), q, kv, kv))
  assert TARGET not in _targets(_lowered(f(2), q, kv, kv))
  with pytest.raises(NotImplementedError, match="at most 2 runs"):
    _lowered(f(2, "cute"), q, kv, kv)
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="max_segments"):
      _lowered(f(bad), q, kv, kv)


def test_backward_call_has_the_tile_counter_scratch(kernels_built):
  """Every backward custom call has a fifth result, int32[2]: the counters from which the sm90 kernels'
  compact schedules claim their tiles (the handler zeroes them; flash_backward drops them)."""
  def loss(q, k, v):
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
  text = _lowered(jax.grad(loss, (0, 1, 2)), *_qkv(t=72, s=33, h=64))
  lines = [line for line in text.splitlines() if "custom_call @jax_padsafe_bwd" in line]
  assert len(lines) == 1
  results = re.findall(r"tensor<[^>]*>", lines[0].rsplit("->", 1)[1])
  assert len(results) == 5 and results[-1] == "tensor<2xi32>", results
