"""CPU tests of the few-query-rows rewrite (``jax_padsafe._backends.cute.split_kv``: GQA heads packed into rows, keys
split into chunks, partials merged through their lse), run on the pure-JAX stand-in of the kernels'
packed forward: the float64 oracle, the contract's exact zeros and bitwise poison invariance; which
calls qualify; and that the CUDA lowering of a decode call is one kernel call on the rewritten layout."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_padsafe
from jax_padsafe._backends.cute import split_kv as _split_kv
from jax_padsafe._core import problem
from jax_padsafe._core.spec import AttentionSpec
from tests import helpers, oracle


def _standin(q, k, v, *args, rows_covered=False, **static):
  del rows_covered  # a performance promise to the kernels; the stand-in zero-fills anyway
  return helpers.standin_flash_forward(q, k, v, *args, **static)


@pytest.fixture
def small_tiles(monkeypatch):
  """Tiles of 8 rows, chunks of at least 8 keys: small problems get packed and split several ways."""
  monkeypatch.setattr(_split_kv, "_TILE_ROWS", 8)
  monkeypatch.setattr(_split_kv, "_MIN_CHUNK", 8)
  monkeypatch.setattr(_split_kv, "_ONE_WAVE", 20)
  monkeypatch.setattr(_split_kv, "_TARGET_TILES", 40)


def _runner(p: oracle.Problem):
  b, t, n, h, s, kh = p.shape
  wl, wr = (-1 if w is None else w for w in (p.window or (None, None)))
  static = dict(max_seqlen_q=t, max_seqlen_k=s, scale=p.scale if p.scale is not None else h ** -0.5,
                causal=p.causal, bottom_right=p.bottom_right, window_left=wl, window_right=wr,
                softcap=p.softcap or 0.0, rows_covered=True)
  fwd = _split_kv.split_kv_to_runs(_standin)
  runs = problem.runs_from_lengths(jnp.asarray(p.q_len), jnp.asarray(p.kv_len))

  @jax.jit
  def run(q, k, v, bias, mask, do, dl):
    del bias, mask, do, dl
    out, lse = fwd(q, k, v, *runs, **static)
    return dict(out=out, lse=lse)

  return run


CASES = [  # (b, t, n, kh, s, q_len, kv_len, extra problem fields)
    (3, 1, 8, 2, 61, [1, 0, 1], [61, 17, 0], {}),                              # decode, GQA 4: packed, split
    (2, 1, 8, 8, 100, [1, 1], [100, 9], dict(causal=True, bottom_right=True)),  # MHA, causal bottom-right
    (2, 3, 4, 1, 45, [3, 2], [7, 45], dict(softcap=20.0)),                     # MQA, 3 rows, softcap
    (1, 5, 6, 3, 200, [4], [150], {}),                                         # T*G = 10 > 8: split only
    (4, 2, 4, 2, 33, [2, 0, 1, 2], [33, 33, 32, 1], {}),                       # a chunk boundary on the length
    # One row with a window: the chunks cover only the keys around the row's position.
    (3, 1, 8, 2, 90, [1, 1, 1], [90, 20, 3], dict(causal=True, bottom_right=True, window=(17, None))),
    (2, 1, 4, 2, 70, [1, 1], [70, 41], dict(bottom_right=True, window=(30, 5))),
    (2, 1, 4, 4, 70, [1, 1], [70, 0], dict(window=(None, 33))),                # top-left: row 0 sees [0, 33]
    (2, 1, 4, 1, 64, [1, 0], [64, 64], dict(causal=True)),                     # top-left causal: key 0 only
    # Several rows, bottom-right causal: the keys before the diagonal split, the diagonal a call of its own.
    (3, 2, 8, 2, 80, [2, 1, 2], [80, 33, 1], dict(causal=True, bottom_right=True)),  # kv_len < q_len: row 0 empty
    (2, 5, 4, 4, 90, [5, 3], [90, 2], dict(causal=True, bottom_right=True, softcap=9.0)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rewrite_keeps_the_contract(small_tiles, case):
  b, t, n, kh, s, q_len, kv_len, extra = CASES[case]
  rng = np.random.default_rng(100 + case)
  p = helpers.random_problem(rng, b=b, t=t, s=s, n=n, k=kh, h=16, q_len=q_len, kv_len=kv_len, **extra)
  wl, wr = (-1 if w is None else w for w in (p.window or (None, None)))
  plan = _split_kv.plan(b, t, n, kh, _split_kv.visible_keys(s, t, p.causal, wl, wr))
  assert plan.changes_call  # the case exercises the rewrite, not the plain path
  runner = _runner(p)
  d_out, d_lse = helpers.cotangents(p, rng)
  for dtype in (jnp.float32, jnp.bfloat16):
    base = helpers.run_padded(p, dtype, runner, poison="zero", d_out=d_out, d_lse=d_lse, rng=rng)
    ref, naive = oracle.expected(p, dtype)
    oracle.assert_close(base, ref, naive, dtype, ["out", "lse"])
    helpers.assert_contract_zeros(p, base, ref)
    for poison in helpers.POISONS:
      got = helpers.run_padded(p, dtype, runner, poison=poison, d_out=d_out, d_lse=d_lse, rng=rng)
      for name in ("out", "lse"):
        helpers.assert_bitwise_equal(got[name], base[name], f"{name} with {poison} in the padding")


def test_plan():
  # One 128k-token sequence, 32 query heads over 8 kv heads: packed (4 rows per head), 32 chunks of 4096.
  assert _split_kv.plan(1, 1, 32, 8, 131072) == _split_kv.Plan(True, 32, 4096)
  # 256 query tiles once packed: a wave or more, so packed but not split.
  assert _split_kv.plan(32, 1, 32, 8, 4096) == _split_kv.Plan(True, 1, 4096)
  # More than one query tile per (sequence, head): prefill, unchanged, however small the grid.
  assert not _split_kv.plan(8, 2048, 16, 16, 2048).changes_call
  assert not _split_kv.plan(1, 512, 8, 8, 65536).changes_call
  # MHA decode: no packing, split only; too few keys to split: unchanged.
  assert _split_kv.plan(4, 1, 16, 16, 8192) == _split_kv.Plan(False, 5, 1664)
  assert not _split_kv.plan(4, 1, 16, 16, 300).changes_call
  # 40 rows x 4 heads do not fit one tile: split only.
  assert _split_kv.plan(1, 40, 8, 2, 65536).pack is False
  for args in [(1, 1, 32, 8, 131072), (3, 2, 12, 4, 1000), (1, 1, 1, 1, 777), (2, 7, 8, 1, 5000)]:
    pl = _split_kv.plan(*args)
    keys = args[-1]
    assert pl.splits >= 1 and (pl.splits - 1) * pl.chunk < keys <= pl.splits * pl.chunk
  # A sliding-window decode splits its window, not the cache.
  assert _split_kv.visible_keys(131072, 1, True, 4095, -1) == 4096
  assert _split_kv.visible_keys(131072, 1, False, 4095, -1) == 131072  # unbounded on the right
  assert _split_kv.visible_keys(131072, 2, True, 4095, -1) == 131072
  assert _split_kv.plan(1, 1, 32, 8, 4096) == _split_kv.Plan(True, 16, 256)


def test_merge_partials_selects():
  """Chunks that saw nothing (lse -inf) never reach the result through a product, even with NaN in o."""
  o = jnp.asarray([[[1.0, 2.0]], [[jnp.nan, jnp.inf]], [[3.0, 4.0]]])  # [P=3, rows=1, H=2]
  lse = jnp.asarray([[0.0], [-jnp.inf], [0.0]])
  out, l = _split_kv.merge_partials(o, lse)
  np.testing.assert_allclose(np.asarray(out), [[2.0, 3.0]])
  np.testing.assert_allclose(np.asarray(l), [np.log(2.0)], rtol=1e-6)
  out, l = _split_kv.merge_partials(o[1:2], lse[1:2])
  assert np.asarray(out).tolist() == [[0.0, 0.0]] and np.isneginf(np.asarray(l)).all()


def _spec(**kw):
  return AttentionSpec(**dict(dict(scale=0.1), **kw))


def _layout(layout="lengths", rows=1, kernel=True):
  """A problem of ``layout`` with ``rows`` query rows per sequence (only its static facts matter)."""
  z = jnp.zeros((1, 1), jnp.int32)
  view = (problem.SeqLens if layout == "packed" else problem.Runs)(z, z, z, z) if kernel else None
  return problem.Problem(z, z, z, z, view, layout=layout, max_seqlen_q=rows, max_seqlen_k=64)


def test_eligible():
  assert _split_kv.eligible(_spec(), _layout(rows=4))
  # One row sees one contiguous key range whatever the mask.
  assert _split_kv.eligible(_spec(causal=True, bottom_right=True), _layout())
  assert _split_kv.eligible(_spec(causal=True), _layout())
  assert _split_kv.eligible(_spec(window_left=8, causal=True, bottom_right=True), _layout())
  # Several rows: without causal masking or a window, or with bottom-right causal masking (the diagonal
  # becomes a call of its own); not top-left causal (a diagonal at the start) or a window.
  assert _split_kv.eligible(_spec(causal=True, bottom_right=True), _layout(rows=2))
  assert not _split_kv.eligible(_spec(causal=True), _layout(rows=2))
  assert not _split_kv.eligible(_spec(window_left=8), _layout(rows=3))
  assert not _split_kv.eligible(_spec(window_left=8, causal=True, bottom_right=True), _layout(rows=3))
  assert _split_kv.eligible(_spec(), _layout("packed"))
  assert _split_kv.eligible(_spec(causal=True, bottom_right=True), _layout("packed"))
  assert not _split_kv.eligible(_spec(causal=True), _layout("packed", rows=2))
  assert not _split_kv.eligible(_spec(), _layout("segments"))  # segment ids: several runs per row
  assert not _split_kv.eligible(_spec(), _layout(kernel=False))


def _lower_decode(b, t, n, kh, s, **kw):
  q = jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, s, kh, 128), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  f = lambda q, k, v, lq, lk: jax_padsafe.dot_product_attention(
      q, k, v, query_seq_lengths=lq, key_value_seq_lengths=lk, implementation="cute", **kw)
  return jax.jit(f).trace(q, k, k, lens, lens).lower(lowering_platforms=("cuda",)).as_text()


def _fwd_calls(text):
  return re.findall(r"stablehlo\.custom_call @jax_padsafe_fwd\((.*?)\) \{(.*?)\} : \((.*?)\) -> \((.*?)\)", text)


@pytest.mark.usefixtures("kernels_built")
def test_decode_lowering_is_one_rewritten_kernel_call():
  # 2 sequences x 1 row, 32 heads over 8 kv heads, 16k keys: packed to 4 rows x 8 heads, split in 16 chunks of 1024.
  plan = _split_kv.plan(2, 1, 32, 8, 16384)
  assert plan == _split_kv.Plan(True, 16, 1024)
  calls = _fwd_calls(_lower_decode(2, 1, 32, 8, 16384, is_causal=True, causal_alignment="bottom_right"))
  assert len(calls) == 1
  _, attrs, operands, _ = calls[0]
  ops_ = [o.strip() for o in operands.split(",")]
  rows = 2 * plan.splits * 4
  assert ops_[:3] == [f"tensor<{rows}x8x128xbf16>", "tensor<32768x8x128xbf16>", "tensor<32768x8x128xbf16>"]
  # The sequence bounds, then no sinks ([0]): a split chunk sees part of its rows, so sinks join after the merge.
  assert ops_[3:] == [f"tensor<{2 * plan.splits + 1}xi32>"] * 2 + [f"tensor<{2 * plan.splits}xi32>"] * 2 + [
      "tensor<0xf32>"]
  for want in ("causal = 0 : i32", "bottom_right = 0 : i32", "max_seqlen_q = 4 : i32", "rows_covered = 1 : i32",
               "window_left = -1 : i32", "window_right = -1 : i32"):
    assert want in attrs, attrs


@pytest.mark.usefixtures("kernels_built")
def test_prefill_and_masked_rows_lowering_unchanged():
  for kw, shape in [(dict(), (2, 512, 32, 8, 512)),  # prefill: more than one tile per (sequence, head)
                    (dict(local_window_size=(64, 0)), (2, 2, 32, 8, 16384)),  # two rows and a window
                    (dict(is_causal=True), (2, 4, 32, 8, 16384))]:  # top-left causal: a diagonal at the start
    b, t, n, kh, s = shape
    calls = _fwd_calls(_lower_decode(b, t, n, kh, s, **kw))
    assert len(calls) == 1
    assert calls[0][2].split(",")[0].strip() == f"tensor<{b * t}x{n}x128xbf16>", kw


@pytest.mark.usefixtures("kernels_built")
def test_speculative_decode_lowering():
  """4 rows, bottom-right causal: the keys before the diagonal packed and split (no mask), the diagonal one
  more unpacked causal call."""
  plan = _split_kv.plan(2, 4, 32, 8, 16384)
  calls = _fwd_calls(_lower_decode(2, 4, 32, 8, 16384, is_causal=True, causal_alignment="bottom_right"))
  assert plan.pack and plan.splits > 1 and len(calls) == 2
  shapes = sorted(c[2].split(",")[0].strip() for c in calls)
  assert shapes == sorted([f"tensor<{2 * plan.splits * 16}x8x128xbf16>", "tensor<8x32x128xbf16>"])
  by_rows = {c[2].split(",")[0].strip(): c[1] for c in calls}
  assert "causal = 0 : i32" in by_rows[f"tensor<{2 * plan.splits * 16}x8x128xbf16>"]
  diag = by_rows["tensor<8x32x128xbf16>"]
  assert "causal = 1 : i32" in diag and "bottom_right = 1 : i32" in diag, diag


@pytest.mark.usefixtures("kernels_built")
def test_sliding_window_decode_lowering():
  """One row with a window of 2048 keys over a 64k cache: the chunks split the window, not the cache."""
  plan = _split_kv.plan(2, 1, 32, 8, _split_kv.visible_keys(65536, 1, True, 2047, -1))
  assert plan == _split_kv.Plan(True, 8, 256)
  calls = _fwd_calls(_lower_decode(2, 1, 32, 8, 65536, is_causal=True, causal_alignment="bottom_right",
                                   local_window_size=(2047, 0)))
  assert len(calls) == 1
  _, attrs, operands, _ = calls[0]
  assert operands.split(",")[0].strip() == f"tensor<{2 * plan.splits * 4}x8x128xbf16>"
  assert "causal = 0 : i32" in attrs and "window_left = -1 : i32" in attrs, attrs

DECODE_CASES = [  # (b, t, n, kh, h, s, dtype, extra problem fields): shapes the real plan packs and / or splits
    (3, 1, 8, 2, 128, 3000, jnp.bfloat16, dict(causal=True, bottom_right=True)),  # GQA 4 decode
    (2, 1, 4, 4, 64, 1500, jnp.float16, {}),                                       # MHA: split only
    (2, 2, 6, 1, 128, 2100, jnp.bfloat16, dict(softcap=30.0)),                     # MQA, two rows, softcap
    (1, 1, 4, 2, 256, 4000, jnp.bfloat16, dict(causal=True, bottom_right=True)),   # hd256
    # sliding-window decode (the chunks split the window) and a one-row top-left window
    (3, 1, 8, 2, 128, 6000, jnp.bfloat16, dict(causal=True, bottom_right=True, window=(1500, None))),
    (2, 1, 4, 4, 64, 3000, jnp.float16, dict(window=(None, 700))),
    (3, 4, 8, 2, 128, 3000, jnp.bfloat16, dict(causal=True, bottom_right=True)),  # speculative decoding: 4 rows
    # sinks, joined to the merged chunks (decode) and with the diagonal call (speculative decoding)
    (3, 1, 8, 2, 128, 3000, jnp.bfloat16, dict(causal=True, bottom_right=True, sinks=True)),
    (2, 3, 4, 4, 64, 2500, jnp.float16, dict(causal=True, bottom_right=True, sinks=True)),
]


@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_contract(impl, case):
  """The whole contract (gradients included) on decode shapes through the public API. With
  impl="cute" (a GPU with the kernels) the forward runs rewritten on the kernels; on the CPU the
  "xla" case checks the same problems on the pure-JAX path."""
  b, t, n, kh, h, s, dtype, extra = DECODE_CASES[case]
  rng = np.random.default_rng(200 + case)
  extra = dict(extra)
  if extra.pop("sinks", False):
    extra["sinks"] = helpers.random_sinks(rng, n)
  kv_len = rng.integers(s // 3, s + 1, size=b)
  kv_len[0] = s if case % 2 else 0  # a full cache, or a valid row with no key
  q_len = np.full(b, t)
  if b > 1:
    q_len[-1] = 0  # a padded batch row
  p = helpers.random_problem(rng, b=b, t=t, s=s, n=n, k=kh, h=h, q_len=q_len, kv_len=kv_len, **extra)
  wl, wr = (-1 if w is None else w for w in (p.window or (None, None)))
  assert _split_kv.plan(b, t, n, kh, _split_kv.visible_keys(s, t, p.causal, wl, wr)).changes_call
  helpers.contract(p, dtype, impl, poisons=("nan", "inf", "huge"))  # skips a variant the library was built without


@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_sharded_decode_runs_shard_local(small_tiles, heads):
  """Batch- and head-sharded decode through the partitioned rewrite: each shard plans from its local
  shapes, no collective, results equal to the unsharded call."""
  from jax.sharding import PartitionSpec as P
  from jax_padsafe._backends import partitioning as _partitioning
  from tests.test_sharding import collectives, compile_for, make_mesh, place

  n, kh = heads
  rng = np.random.default_rng(7 * n + kh)
  b, t, s, h = 4, 1, 96, 16
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
  runs = problem.runs_from_lengths(jnp.array([1, 1, 0, 1], jnp.int32), jnp.array([96, 40, 7, 0], jnp.int32))
  static = dict(max_seqlen_q=t, max_seqlen_k=s, scale=0.25, causal=True, bottom_right=True, window_left=-1,
                window_right=-1, softcap=0.0, rows_covered=True)
  rewrite = _split_kv.split_kv_to_runs(_standin)
  assert _split_kv.plan(b // 2, t, n // (2 if kh > 1 else 1), max(kh // 2, 1), s).changes_call
  expected = rewrite(q, k, v, *runs, **static)
  unsplit = _partitioning.packed_to_runs(_standin)(q, k, v, *runs, **static)
  for a, e in zip(expected, unsplit):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-6, atol=2e-6)
  fn = _partitioning.partition_runs_forward(rewrite)
  mesh = make_mesh((2, 2), ("data", "model"))
  kv_heads = "model" if kh > 1 else None
  specs = (P("data", None, "model"), P("data", None, kv_heads), P("data", None, kv_heads)) + (P("data"),) * 4
  args = (q, k, v) + tuple(runs)
  compiled, hlo = compile_for(lambda *a: fn(*a, **static), mesh, args, specs)
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  assert collectives(hlo) == []
  for a, e in zip(got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)


PACKED_CASES = [  # caps_q, used_q, caps_k, used_k, extra problem fields: the packed layout (varlen decoding)
    ([1, 1, 1, 1], [1, 0, 1, 1], [40, 50, 30, 64], [40, 17, 0, 64], dict(causal=True, bottom_right=True)),
    ([2, 3], [2, 1], [33, 70], [30, 70], dict(softcap=5.0)),
    ([1, 1, 1], [1, 1, 1], [90, 20, 64], [90, 20, 3], dict(causal=True, bottom_right=True, window=(17, None))),
    ([3, 2], [3, 1], [70, 60], [70, 2], dict(causal=True, bottom_right=True)),
]


@pytest.mark.parametrize("case", range(len(PACKED_CASES)))
def test_packed_rewrite_keeps_the_contract(small_tiles, case):
  caps_q, used_q, caps_k, used_k, extra = PACKED_CASES[case]
  rng = np.random.default_rng(300 + case)
  d = helpers.build_packed(rng, caps_q, used_q, caps_k, used_k, n=8, k=2, h=16, **extra)
  p = d["problem"]
  wl, wr = (-1 if w is None else w for w in (p.window or (None, None)))
  static = dict(max_seqlen_q=max(caps_q), max_seqlen_k=max(caps_k), scale=16 ** -0.5, causal=p.causal,
                bottom_right=p.bottom_right, window_left=wl, window_right=wr, softcap=p.softcap or 0.0,
                rows_covered=False)
  assert _split_kv._plan_for(static, len(caps_q), max(caps_q), 8, 2, max(caps_k)).changes_call
  rewrite = _split_kv.split_kv_packed(_standin)
  cu_q, cu_k = jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"])
  uq, uk = jnp.asarray(d["used_q"], jnp.int32), jnp.asarray(d["used_k"], jnp.int32)
  fn = jax.jit(lambda q, k, v: rewrite(q, k, v, cu_q, cu_k, uq, uk, **static))
  for dtype in (jnp.float32, jnp.bfloat16):
    def run(poison):
      qv, kv = d["valid_q"][None], d["valid_k"][None]
      args = [jnp.asarray(helpers.poison_rows(d[x][None], val, poison, rng)[0], dtype)
              for x, val in (("q", qv), ("k", kv), ("v", kv))]
      return dict(zip(("out", "lse"), (np.asarray(a) for a in fn(*args))))
    base = run("zero")
    ref, naive = oracle.expected(d["packed"], dtype)
    oracle.assert_close(base, ref, naive, dtype, ["out", "lse"])
    assert np.all(base["out"][~d["valid_q"]] == 0) and np.all(base["lse"][:, ~d["valid_q"]] == 0)
    for poison in helpers.POISONS:
      got = run(poison)
      for name in ("out", "lse"):
        helpers.assert_bitwise_equal(got[name], base[name], f"packed {name} with {poison}")


@pytest.mark.usefixtures("kernels_built")
def test_packed_decode_lowering():
  """varlen_attention with one query row per sequence: one kernel call on the packed-and-split layout."""
  b, n, kh, total_k = 4, 32, 8, 40000
  q = jax.ShapeDtypeStruct((b, n, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((total_k, kh, 128), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((b + 1,), jnp.int32)
  f = lambda q, k, v, cu_q, cu_k: jax_padsafe.varlen_attention(
      q, k, v, cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=16384, is_causal=True, causal_alignment="bottom_right",
      implementation="cute")
  text = jax.jit(f).trace(q, k, k, cu, cu).lower(lowering_platforms=("cuda",)).as_text()
  calls = _fwd_calls(text)
  plan = _split_kv.plan(b, 1, n, kh, 16384)
  assert plan.pack and plan.splits > 1 and len(calls) == 1
  assert calls[0][2].split(",")[0].strip() == f"tensor<{b * plan.splits * 4}x8x128xbf16>"
  assert "causal = 0 : i32" in calls[0][1]


PACKED_DECODE_CASES = [  # caps_q, used_q, caps_k, used_k, extra: real tiles (GPU: the kernels run the rewrite)
    ([1, 1, 1, 1], [1, 0, 1, 1], [3000, 2000, 1200, 2600], [2999, 1000, 0, 2600], dict(causal=True, bottom_right=True)),
    ([2, 3], [2, 3], [1700, 2500], [1700, 1111], {}),
    ([1, 1, 1], [1, 1, 1], [4000, 900, 3100], [4000, 900, 3100], dict(causal=True, bottom_right=True, window=(700, None))),
    ([4, 3], [4, 3], [2500, 1900], [2500, 2], dict(causal=True, bottom_right=True)),
]


@pytest.mark.parametrize("case", range(len(PACKED_DECODE_CASES)))
def test_packed_decode_contract(impl, case):
  """The whole packed-layout contract (gradients included) on decode shapes through varlen_attention."""
  caps_q, used_q, caps_k, used_k, extra = PACKED_DECODE_CASES[case]
  rng = np.random.default_rng(400 + case)
  d = helpers.build_packed(rng, caps_q, used_q, caps_k, used_k, n=8, k=2, h=128, **extra)
  p = d["problem"]
  wl, wr = (-1 if w is None else w for w in (p.window or (None, None)))
  static = dict(causal=p.causal, window_left=wl, window_right=wr)
  assert _split_kv._plan_for(static, len(caps_q), max(caps_q), 8, 2, max(caps_k)).changes_call
  helpers.check_packed(d, helpers.dtype_for(impl, jnp.float32), impl, rng)
