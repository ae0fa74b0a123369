"""Flax (linen, NNX) and Equinox layers: same function as the frameworks' own attention layers on
unpadded data, and the pad-safety contract on padded data (NaN in the padding changes nothing)."""



import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest



B, T, F, HEADS = 2, 8, 32, 4
LENS = np.array([8, 5], np.int32)
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
  # GPUs run float32 matmuls as TF32 by default; compare with Flax/Equinox at full precision.
  with jax.default_matmul_precision("highest"):
    yield


def _inputs(seed=0, b=B, t=T, f=F):
  return jax.random.normal(jax.random.key(seed), (b, t, f), jnp.float32)


def _poison(x, lens, value=jnp.nan):
  rows = jnp.arange(x.shape[-2])
  return jnp.where((rows[None, :] < jnp.asarray(lens)[:, None])[..., None], x, value)


def _zero_pad(x, lens):
  return _poison(x, lens, 0.0)


def _assert_tree_finite_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert np.isfinite(x).all()
    np.testing.assert_array_equal(x, y)


def _check_padded_output(out_clean, out_poisoned, lens):
  out_clean, out_poisoned = np.asarray(out_clean), np.asarray(out_poisoned)
  assert np.isfinite(out_poisoned).all()
  np.testing.assert_array_equal(out_clean, out_poisoned)  # bitwise, padded rows included
  for b, n in enumerate(lens):
    assert (out_poisoned[b, n:] == 0).all()


def test_layers_import_lazily():
  import subprocess
  import sys
  code = ("import sys, jax_padsafe; "
          "assert not any(m.split('.')[0] in ('flax', 'equinox') for m in sys.modules), 'eager'")
  subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------- linen --

@pytest.fixture(scope="module")
def linen():
  pytest.importorskip("flax")
  import flax.linen as nn
  from jax_padsafe import flax_linen
  return nn, flax_linen


@pytest.mark.parametrize("causal", [False, True])
def test_linen_attention_fn_matches_flax(linen, causal):
  nn, pl = linen
  x = _inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = ref.init(jax.random.key(1), x)
  mask = nn.make_causal_mask(jnp.ones((B, T))) if causal else None
  want = ref.apply(params, x, mask=mask)
  swapped = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=pl.attention_fn)
  got = jax.jit(swapped.apply)(params, x, mask=mask)
  np.testing.assert_allclose(got, want, **TOL)
  with_options = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, attention_fn=pl.make_attention_fn(is_causal=causal))
  np.testing.assert_allclose(jax.jit(with_options.apply)(params, x), want, **TOL)


def test_linen_attention_fn_extra_batch_dims(linen):
  nn, pl = linen
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 3, T, HEADS, 16)) for i in range(3))
  mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 3, 1, T, T)).at[..., 0].set(True)
  np.testing.assert_allclose(jax.jit(pl.attention_fn)(q, k, v, mask=mask),
                             nn.dot_product_attention(q, k, v, mask=mask), **TOL)


def test_linen_attention_fn_in_flax_decode_mode(linen):
  # linen's own KV cache (decode=True) passes a float cache mask: runs on the pure-JAX path.
  nn, pl = linen
  x = _inputs(t=4)
  outs = {}
  for name, fn in (("flax", nn.dot_product_attention), ("padsafe", pl.attention_fn)):
    layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True, attention_fn=fn)
    variables = layer.init(jax.random.key(1), x)
    step = jax.jit(lambda v, tok, layer=layer: layer.apply(v, tok, mutable=["cache"]))
    cache, out = variables["cache"], []
    for i in range(x.shape[1]):
      o, mutated = step({"params": variables["params"], "cache": cache}, x[:, i:i + 1])
      cache = mutated["cache"]
      out.append(o)
    outs[name] = jnp.concatenate(out, 1)
  np.testing.assert_allclose(outs["padsafe"], outs["flax"], **TOL)


def test_linen_module_same_params_as_flax(linen):
  nn, pl = linen
  x = _inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, normalize_qk=True)
  mine = pl.MultiHeadAttention(num_heads=HEADS, normalize_qk=True)
  p_ref, p_mine = ref.init(jax.random.key(1), x), mine.init(jax.random.key(1), x)
  assert jax.tree.structure(p_ref) == jax.tree.structure(p_mine)
  _assert_tree_finite_equal(p_ref, p_mine)
  np.testing.assert_allclose(jax.jit(mine.apply)(p_ref, x), ref.apply(p_ref, x), **TOL)


def test_linen_module_padded_contract(linen):
  nn, pl = linen
  x = _inputs()
  layer = pl.MultiHeadAttention(num_heads=HEADS, is_causal=True)
  params = layer.init(jax.random.key(1), x)

  @jax.jit
  @functools.partial(jax.value_and_grad, has_aux=True)
  def loss(params, x):
    out = layer.apply(params, x, query_seq_lengths=LENS)
    return jnp.sum(out ** 2), out

  (_, clean), g_clean = loss(params, _zero_pad(x, LENS))
  (_, dirty), g_dirty = loss(params, _poison(x, LENS))
  _check_padded_output(clean, dirty, LENS)
  _assert_tree_finite_equal(g_clean, g_dirty)
  # Valid rows equal Flax's layer on each sequence alone.
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  for b, n in enumerate(LENS):
    want = ref.apply(params, x[b:b + 1, :n], mask=nn.make_causal_mask(jnp.ones((1, n))))
    np.testing.assert_allclose(clean[b:b + 1, :n], want, **TOL)


def test_linen_attention_fn_with_lengths_is_poison_invariant(linen):
  _, pl = linen
  q, k, v = (jax.random.normal(jax.random.key(i), (B, T, HEADS, 16)) for i in range(3))
  fn = pl.make_attention_fn(query_seq_lengths=LENS, key_value_seq_lengths=LENS, is_causal=True)
  poison = lambda x: jnp.where((jnp.arange(T)[None, :] < LENS[:, None])[..., None, None], x, jnp.nan)
  fn = jax.jit(fn)
  _check_padded_output(fn(q, k, v), fn(poison(q), poison(k), poison(v)), LENS)


def test_linen_refuses_dropout_and_sow(linen):
  nn, pl = linen
  x = _inputs()
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1,
                                          attention_fn=pl.attention_fn)
  params = layer.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x,
                      deterministic=True)
  layer.apply(params, x, deterministic=True)  # fine: no dropout applied
  with pytest.raises(NotImplementedError, match="dropout"):
    layer.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  with pytest.raises(NotImplementedError, match="sow"):
    nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=pl.attention_fn).apply(
        params, x, sow_weights=True, mutable=["intermediates"])


# ------------------------------------------------------------------------------------------ nnx --

@pytest.fixture(scope="module")
def nnx_mod():
  pytest.importorskip("flax")
  from flax import nnx
  from jax_padsafe import flax_nnx
  return nnx, flax_nnx


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_nnx_matches_flax(nnx_mod, num_kv_heads):
  nnx, pn = nnx_mod
  x = _inputs()
  ref = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=num_kv_heads, decode=False,
                               rngs=nnx.Rngs(0))
  mine = pn.MultiHeadAttention(HEADS, F, num_kv_heads=num_kv_heads, is_causal=True,
                               rngs=nnx.Rngs(0))
  _assert_tree_finite_equal(nnx.state(ref, nnx.Param), nnx.state(mine, nnx.Param))
  want = ref(x, mask=jnp.tril(jnp.ones((T, T), bool)))
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(mine, x), want, **TOL)


def test_nnx_padded_contract_packed(nnx_mod):
  nnx, pn = nnx_mod
  x = _inputs()
  # Two packed sequences per row, then padding (segment id -1).
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, -1, -1, -1]], jnp.int32)
  lens = np.array([8, 5])
  layer = pn.MultiHeadAttention(HEADS, F, is_causal=True, rope=pn.apply_rope, rngs=nnx.Rngs(0))

  def loss(layer, x):
    out = layer(x, query_segment_ids=seg)
    return jnp.sum(out ** 2), out

  grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (_, clean), g_clean = grad(layer, _zero_pad(x, lens))
  (_, dirty), g_dirty = grad(layer, _poison(x, lens))
  _check_padded_output(clean, dirty, lens)
  _assert_tree_finite_equal(nnx.state(g_clean), nnx.state(g_dirty))
  # Each packed segment equals the layer run on that segment alone (RoPE positions restart).
  for b, start, stop in [(0, 0, 3), (0, 3, 8), (1, 0, 2), (1, 2, 5)]:
    alone = nnx.jit(lambda m, x: m(x))(layer, x[b:b + 1, start:stop])
    np.testing.assert_allclose(clean[b:b + 1, start:stop], alone, **TOL)


def test_nnx_kv_cache_decode_per_sequence_lengths(nnx_mod):
  nnx, pn = nnx_mod
  x = _inputs(t=10)
  prompt = np.array([4, 2], np.int32)
  layer = pn.MultiHeadAttention(HEADS, F, num_kv_heads=2, is_causal=True, rope=pn.apply_rope,
                                rngs=nnx.Rngs(0))
  full = nnx.jit(lambda m, x: m(x))(layer, x)  # causal over the whole sequence: the reference for every position
  layer.init_cache((B, 10, F))
  # Prefill: sequence b's first prompt[b] tokens; the rest of the block is NaN padding.
  block = _poison(x[:, :4], prompt)
  out = nnx.jit(lambda m, x, n: m(x, query_seq_lengths=n, decode=True))(layer, block, prompt)
  assert np.isfinite(np.asarray(out)).all()
  for b, n in enumerate(prompt):
    np.testing.assert_allclose(out[b, :n], full[b, :n], **TOL)
    assert (np.asarray(out[b, n:]) == 0).all()
  np.testing.assert_array_equal(layer.cache_lengths[...], prompt)
  # Decode one token per step; each sequence continues from its own length.
  step = nnx.jit(lambda layer, tok: layer(tok, decode=True))
  for i in range(3):
    tok = jnp.stack([x[b, prompt[b] + i] for b in range(B)])[:, None]
    out = step(layer, tok)
    for b in range(B):
      np.testing.assert_allclose(out[b, 0], full[b, prompt[b] + i], **TOL)
  np.testing.assert_array_equal(layer.cache_lengths[...], prompt + 3)
  with pytest.raises(ValueError, match="overflow"):
    layer(x[:, :8], decode=True)


def test_nnx_refuses_dropout(nnx_mod):
  nnx, pn = nnx_mod
  layer = pn.MultiHeadAttention(HEADS, F, dropout_rate=0.1, rngs=nnx.Rngs(0))
  x = _inputs()
  layer(x, deterministic=True)
  with pytest.raises(NotImplementedError, match="dropout"):
    layer(x, deterministic=False)


# -------------------------------------------------------------------------------------- equinox --

@pytest.fixture(scope="module")
def eqx_mod():
  eqx = pytest.importorskip("equinox")
  from jax_padsafe import equinox as pe
  return eqx, pe


def test_equinox_matches_equinox(eqx_mod):
  eqx, pe = eqx_mod
  x = _inputs()
  ref = eqx.nn.MultiheadAttention(HEADS, F, use_query_bias=True, key=jax.random.key(3))
  mine = pe.MultiheadAttention(HEADS, F, use_query_bias=True, key=jax.random.key(3))
  _assert_tree_finite_equal(eqx.filter(ref, eqx.is_array), eqx.filter(mine, eqx.is_array))
  got = eqx.filter_jit(lambda m, x: jax.vmap(m)(x, x, x))(mine, x)
  np.testing.assert_allclose(got, jax.vmap(ref)(x, x, x), **TOL)
  mask = jnp.tril(jnp.ones((T, T), bool))
  np.testing.assert_allclose(jax.jit(jax.vmap(lambda x: mine(x, x, x, mask)))(x),
                             jax.vmap(lambda x: ref(x, x, x, mask))(x), **TOL)
  rope = eqx.nn.RotaryPositionalEmbedding(F // HEADS)

  def process_heads(q, k, v):
    return jax.vmap(rope, in_axes=1, out_axes=1)(q), jax.vmap(rope, in_axes=1, out_axes=1)(k), v

  np.testing.assert_allclose(
      jax.jit(jax.vmap(lambda x: mine(x, x, x, process_heads=process_heads)))(x),
      jax.vmap(lambda x: ref(x, x, x, process_heads=process_heads))(x), **TOL)


def test_equinox_padded_contract(eqx_mod):
  eqx, pe = eqx_mod
  x = _inputs()
  layer = pe.MultiheadAttention(HEADS, F, num_kv_heads=2, is_causal=True, key=jax.random.key(3))

  @eqx.filter_jit
  @eqx.filter_value_and_grad(has_aux=True)
  def loss(layer, x):
    out = jax.vmap(lambda x, n: layer(x, x, x, query_length=n, kv_length=n))(x, LENS)
    return jnp.sum(out ** 2), out

  (_, clean), g_clean = loss(layer, _zero_pad(x, LENS))
  (_, dirty), g_dirty = loss(layer, _poison(x, LENS))
  _check_padded_output(clean, dirty, LENS)
  _assert_tree_finite_equal(eqx.filter(g_clean, eqx.is_array), eqx.filter(g_dirty, eqx.is_array))
  with pytest.raises(NotImplementedError, match="dropout"):
    pe.MultiheadAttention(HEADS, F, dropout_p=0.1, key=jax.random.key(0))(x[0], x[0], x[0])


def test_apply_rope_rotates_pairs():
  from jax_padsafe._core.layers import apply_rope
  x = jax.random.normal(jax.random.key(0), (1, T, 2, 16))
  pos = jnp.arange(T)
  y = apply_rope(x, pos)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_array_equal(y[:, 0], x[:, 0])
  # Relative: <rope(q, i), rope(k, j)> depends on i - j only.
  q, k = x[:, :1], x[:, 1:2]
  a = jnp.sum(apply_rope(q, jnp.array([5])) * apply_rope(k, jnp.array([3])))
  b = jnp.sum(apply_rope(q, jnp.array([9])) * apply_rope(k, jnp.array([7])))
  np.testing.assert_allclose(a, b, rtol=1e-4)





# ---------------------------------------------------------------------------- sinks, ALiBi, Hv --

def test_nnx_sinks_parameter(nnx_mod):
  """use_sinks adds a learnable ``sinks [num_heads]`` (zeros by default) after Flax's parameters: the
  others stay those of one seed; sinks of -inf give the layer without sinks; finite sinks give
  dot_product_attention(sinks=...) on the projections; the sinks get a gradient; NaN padding changes
  nothing; decoding with the cache uses them too."""
  nnx, pn = nnx_mod
  x = _inputs()
  plain = pn.MultiHeadAttention(HEADS, F, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
  layer = pn.MultiHeadAttention(HEADS, F, num_kv_heads=2, is_causal=True, use_sinks=True, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(layer.sinks[...], np.zeros(HEADS, np.float32))
  for name in ("query", "key", "value", "out"):
    _assert_tree_finite_equal(nnx.state(getattr(plain, name)), nnx.state(getattr(layer, name)))
  layer.sinks[...] = jnp.full((HEADS,), -jnp.inf)
  np.testing.assert_array_equal(layer(x, query_seq_lengths=LENS), plain(x, query_seq_lengths=LENS))

  sinks = jnp.asarray([0.5, -1.0, 2.0, 1.0], jnp.float32)
  layer.sinks[...] = sinks
  q, k, v = layer.query(x), layer.key(x), layer.value(x)
  attn = jax_padsafe_attention(q, k, v, is_causal=True, sinks=sinks, query_seq_lengths=LENS,
                               key_value_seq_lengths=LENS)
  want = jnp.where((jnp.arange(T)[None, :] < LENS[:, None])[..., None], layer.out(attn), 0.0)
  np.testing.assert_allclose(layer(x, query_seq_lengths=LENS), want, **TOL)
  assert not np.allclose(layer(x), plain(x), atol=1e-3), "finite sinks must change the output"

  def loss(layer, x):
    out = layer(x, query_seq_lengths=LENS)
    return jnp.sum(out ** 2), out

  grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (_, clean), g_clean = grad(layer, _zero_pad(x, LENS))
  (_, dirty), g_dirty = grad(layer, _poison(x, LENS))
  _check_padded_output(clean, dirty, LENS)
  _assert_tree_finite_equal(nnx.state(g_clean), nnx.state(g_dirty))
  assert np.all(np.asarray(g_clean.sinks[...]) != 0)

  full = layer(x)  # causal over the whole sequence: what decoding token by token must give
  layer.init_cache((B, T, F))
  step = nnx.jit(lambda layer, tok: layer(tok, decode=True))
  for i in range(3):
    np.testing.assert_allclose(step(layer, x[:, i:i + 1])[:, 0], full[:, i], **TOL)


def jax_padsafe_attention(*args, **kw):
  import jax_padsafe  # pylint: disable=g-import-not-at-top
  return jax_padsafe.dot_product_attention(*args, **kw)


def test_nnx_alibi_slopes_per_batch_element(nnx_mod):
  """alibi_slopes of shape [batch..., heads] reach every batch element with its own slopes."""
  nnx, pn = nnx_mod
  x = _inputs()
  layer = pn.MultiHeadAttention(HEADS, F, is_causal=True, rngs=nnx.Rngs(0))
  slopes = jnp.asarray([[0.5, 0.25, 0.125, 0.0625], [1.0, 0.0, 2.0, 0.3]], jnp.float32)
  both = layer(x, alibi_slopes=slopes)
  for b in range(B):
    np.testing.assert_allclose(both[b:b + 1], layer(x[b:b + 1], alibi_slopes=slopes[b]), **TOL)
  assert not np.allclose(both, layer(x), atol=1e-3)


def test_linen_sinks_parameter(linen):
  nn, pl = linen
  x = _inputs()
  plain = pl.MultiHeadAttention(num_heads=HEADS, is_causal=True)
  layer = pl.MultiHeadAttention(num_heads=HEADS, is_causal=True, use_sinks=True)
  params = layer.init(jax.random.key(0), x)
  assert params["params"]["sinks"].shape == (HEADS,)
  no_sinks = {"params": {n: p for n, p in params["params"].items() if n != "sinks"}}
  off = {"params": dict(params["params"], sinks=jnp.full((HEADS,), -jnp.inf))}
  np.testing.assert_array_equal(layer.apply(off, x, query_seq_lengths=LENS),
                                plain.apply(no_sinks, x, query_seq_lengths=LENS))
  g = jax.grad(lambda p: jnp.sum(layer.apply(p, x, query_seq_lengths=LENS) ** 2))(params)
  assert np.all(np.isfinite(g["params"]["sinks"])) and np.any(g["params"]["sinks"] != 0)


def test_equinox_sinks_alibi_and_value_size(eqx_mod):
  """The Equinox layer with vo_size != qk_size (a value head dim of its own), sinks and ALiBi slopes
  per call: the same as dot_product_attention on its projections; the sinks get a gradient."""
  eqx, pe = eqx_mod
  x = _inputs()
  layer = pe.MultiheadAttention(HEADS, F, qk_size=4, vo_size=12, is_causal=True, key=jax.random.key(3))
  sinks = jnp.asarray([0.1, 1.0, -0.5, 2.0], jnp.float32)
  slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
  got = jax.vmap(lambda x: layer(x, x, x, sinks=sinks, alibi_slopes=slopes))(x)
  q = jax.vmap(jax.vmap(layer.query_proj))(x).reshape(B, T, HEADS, 4)
  k = jax.vmap(jax.vmap(layer.key_proj))(x).reshape(B, T, HEADS, 4)
  v = jax.vmap(jax.vmap(layer.value_proj))(x).reshape(B, T, HEADS, 12)
  attn = jax_padsafe_attention(q, k, v, is_causal=True, sinks=sinks, alibi_slopes=slopes)
  want = jax.vmap(jax.vmap(layer.output_proj))(attn.reshape(B, T, HEADS * 12))
  np.testing.assert_allclose(got, want, **TOL)
  g = jax.grad(lambda s: jnp.sum(jax.vmap(lambda x: layer(x, x, x, sinks=s))(x) ** 2))(sinks)
  assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0)
