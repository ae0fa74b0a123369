"""Big problems on the GPU kernels: tensors of more than 2**31 elements, and one very long sequence.  Marked
``large`` as well as ``gpu`` (deselect with ``-m "gpu and not large"``); they need ~60 GB of GPU memory.

Why: the kernels take int32 sizes and int64 row strides.  A row offset computed in 32 bits would wrap once q/k/v
hold more than 2**31 elements (2.25M packed tokens x 8 heads x 128), and the kernels would read and write another
sequence's rows, silently; and a 128k-token sequence walks 1000 tiles deep.  Forward and backward through the
public API (``implementation="cute"``, bf16, head dim 128, 8 heads) of

* varlen: ~2.25M packed tokens, causal, irregular lengths and gaps (seqused < slot) holding NaN;
* dense: ``[B, 4096, 8, 128]`` with B such that q holds more than 2**31 elements, random lengths, +Inf in the
  padded rows;
* long: one causal sequence of 131072 tokens (GQA 8 / 2) in a slot 1000 rows longer holding NaN or 1e30.

For varlen and dense, the first sequence, the one straddling element 2**31 and the last one are compared bitwise
with the same sequence run alone (O, lse, dq, dk, dv), and the straddling one with the float64 oracle by the
accuracy rule.  For long, the first and last 64 query rows (and the last 64 keys' dk, dv, which only those rows
see) are compared with the oracle, and the results with NaN and with 1e30 in the padding bitwise.  On Hopper the
SM80-class family runs the same tests in a fresh process (JAX_PADSAFE_SM90=0).

About 150 s on an H100 (both families).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers, oracle
from tests.gpu import cases

pytestmark = cases.needs_kernels() + [pytest.mark.large]

N, H = 8, 128
DT = jnp.bfloat16
LIMIT = 2 ** 31            # the element count the varlen and dense tensors exceed
TOKENS, MAX_LEN = 2_250_000, 4096  # varlen: packed tokens, longest sequence (and the dense padded length)
LONG = 131072              # the one long sequence


def test_sm80_class_family_on_hopper():
  """First in the module, so that this process holds little GPU memory while the fresh one runs."""
  if not cases.is_hopper():
    pytest.skip("the SM80-class family is the default here: the tests below run it")
  if not cases.sm90_family_active():
    pytest.skip("this process already runs the SM80-class family")
  cases.run_pytest(["-m", "gpu and large", "tests/gpu/test_large.py", "-k", "not sm80_class"],
                   {"JAX_PADSAFE_SM90": "0"}, timeout=540)


def _loss_and_grads(fn, q, k, v, g):
  """O, lse and the gradients of ``sum(o * g) + sum(lse)`` (over finite lse), one jitted call."""
  def loss(q, k, v, g):  # g an argument, not a captured constant (gigabytes of it would be baked in)
    o, lse = fn(q, k, v)
    dot = jnp.sum(o.astype(jnp.float32) * g.astype(jnp.float32))
    return dot + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (o, lse)

  (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, g)
  return (o, lse) + tuple(grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def _bitwise(whole, alone, what):
  for name, a, b in zip(NAMES, whole, alone):
    helpers.assert_bitwise_equal(np.asarray(a), np.asarray(b), f"{what}: {name}")


def _accuracy(ours, q, k, v, g, causal, what):
  """ours = (o [L, N, H], lse [N, L], dq, dk, dv) of one whole sequence against the oracle (d_lse = 1)."""
  p = oracle.Problem(q=np.asarray(q, np.float64)[None], k=np.asarray(k, np.float64)[None],
                     v=np.asarray(v, np.float64)[None], q_len=np.array([q.shape[0]]), kv_len=np.array([k.shape[0]]),
                     causal=causal)
  ref, naive = oracle.expected(p, DT, np.asarray(g, np.float64)[None], np.ones((1, N, q.shape[0])))
  mine = {name: np.asarray(x, np.float64)[None] for name, x in zip(NAMES, ours)}
  try:
    oracle.assert_close(mine, ref, naive, DT, NAMES)
  except AssertionError as e:
    raise AssertionError(f"{what}: {e}") from e


def test_varlen_past_2_31_elements():
  rng = np.random.default_rng(0)
  max_len, lens, used = MAX_LEN, [], []
  while sum(lens) < TOKENS:
    seg = int(rng.integers(1, max_len + 1))
    lens.append(seg)
    used.append(seg if rng.random() < 0.5 else int(rng.integers(0, seg + 1)))
  lens, used = np.array(lens), np.array(used, np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  total = int(cu[-1])
  assert total * N * H > LIMIT
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(1), 4)
  valid = np.zeros(total, bool)
  for b in range(len(lens)):
    valid[cu[b]:cu[b] + used[b]] = True
  pad = jnp.asarray(~valid)[:, None, None]
  q, k, v = (jnp.where(pad, jnp.nan, jax.random.normal(key, (total, N, H), DT)) for key in (kq, kk, kv))
  g = jax.random.normal(kg, (total, N, H), DT)

  def fn(q, k, v, cu=cu, used=used):
    return jax_padsafe.varlen_attention(q, k, v, jnp.asarray(cu), jnp.asarray(cu), seqused_q=jnp.asarray(used),
                                        seqused_k=jnp.asarray(used), is_causal=True, return_lse=True,
                                        implementation="cute", max_seqlen_q=max_len, max_seqlen_k=max_len)

  whole = _loss_and_grads(fn, q, k, v, g)
  straddle = int(np.searchsorted(cu, LIMIT // (N * H), side="right") - 1)
  for label, b in (("first", 0), ("straddling 2**31", straddle), ("last", len(lens) - 1)):
    while used[b] == 0 and b > 0:
      b -= 1
    s = slice(int(cu[b]), int(cu[b + 1]))
    alone = _loss_and_grads(lambda q_, k_, v_: fn(q_, k_, v_, cu=np.array([0, lens[b]], np.int32),
                                                  used=used[b:b + 1]), q[s], k[s], v[s], g[s])
    mine = (whole[0][s], whole[1][:, s], whole[2][s], whole[3][s], whole[4][s])
    _bitwise(mine, alone, f"varlen {label} sequence {b} (rows {s.start}..{s.stop}) vs alone")
    for name, x in zip(NAMES, mine):
      if name != "lse":
        assert bool(jnp.all(jnp.isfinite(x))), f"varlen {label}: {name} not finite"
    if label == "straddling 2**31":
      r = slice(s.start, s.start + int(used[b]))
      _accuracy((whole[0][r], whole[1][:, r], whole[2][r], whole[3][r], whole[4][r]), q[r], k[r], v[r], g[r],
                True, f"varlen sequence {b}")


def test_dense_past_2_31_elements():
  s_len = MAX_LEN
  b_total = LIMIT // (s_len * N * H) + 8
  lens = np.random.default_rng(2).integers(1, s_len + 1, size=b_total).astype(np.int32)
  lens[-1] = s_len
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(3), 4)
  pad = jnp.arange(s_len)[None, :, None, None] >= jnp.asarray(lens)[:, None, None, None]
  q, k, v = (jnp.where(pad, jnp.inf, jax.random.normal(key, (b_total, s_len, N, H), DT)) for key in (kq, kk, kv))
  g = jax.random.normal(kg, (b_total, s_len, N, H), DT)

  def fn(q, k, v, lens=lens):
    return jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.asarray(lens),
                                             key_value_seq_lengths=jnp.asarray(lens), return_lse=True,
                                             implementation="cute")

  whole = _loss_and_grads(fn, q, k, v, g)
  for label, b in (("first", 0), ("straddling 2**31", LIMIT // (s_len * N * H)), ("last", b_total - 1)):
    s = slice(b, b + 1)
    alone = _loss_and_grads(lambda q_, k_, v_: fn(q_, k_, v_, lens=lens[s]), q[s], k[s], v[s], g[s])
    _bitwise([x[s] for x in whole], alone, f"dense {label} (batch row {b}, length {lens[b]}) vs alone")
    n = int(lens[b])
    for name, x in zip(NAMES, whole):
      if name != "lse":
        assert bool(jnp.all(x[b, n:] == 0)), f"dense {label}: padded rows of {name} not exactly 0"
    if label == "straddling 2**31":
      _accuracy((whole[0][b, :n], whole[1][b, :, :n], whole[2][b, :n], whole[3][b, :n], whole[4][b, :n]),
                q[b, :n], k[b, :n], v[b, :n], g[b, :n], False, f"dense batch row {b}")


def test_long_sequence():
  length, kv_heads, edge = LONG, 2, 64
  slot = length + 1000
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(4), 4)
  pad = (jnp.arange(slot) >= length)[:, None, None]
  mk = lambda key, heads, poison: jnp.where(pad, poison, jax.random.normal(key, (slot, heads, H), DT))  # noqa: E731
  g = jax.random.normal(kg, (slot, N, H), DT)
  cu, used = np.array([0, slot], np.int32), np.array([length], np.int32)

  def fn(q, k, v):
    return jax_padsafe.varlen_attention(q, k, v, jnp.asarray(cu), jnp.asarray(cu), seqused_q=jnp.asarray(used),
                                        seqused_k=jnp.asarray(used), is_causal=True, return_lse=True,
                                        implementation="cute", max_seqlen_q=slot, max_seqlen_k=slot)

  runs = {}
  for poison in (np.nan, 1e30):
    runs[poison] = [np.asarray(x) for x in _loss_and_grads(
        fn, mk(kq, N, poison), mk(kk, kv_heads, poison), mk(kv, kv_heads, poison), g)]
  _bitwise(runs[np.nan], runs[1e30], "long sequence, NaN vs 1e30 in the padding")
  o, lse, dq, dk, dv = runs[np.nan]
  for name, x in (("out", o), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(x[length:] == 0), f"padded rows of {name} not exactly 0"
  assert np.all(lse[:, length:] == 0), "padded lse not exactly 0"
  q, k, v, g = (np.asarray(x[:length], np.float64) for x in (mk(kq, N, 0.0), mk(kk, kv_heads, 0.0),
                                                              mk(kv, kv_heads, 0.0), g))
  # The first rows see only the first keys (their dk/dv also get every later row's share: not compared); the
  # last rows, bottom-right aligned against every key, are the only ones that see the last keys.
  first = oracle.Problem(q=q[None, :edge], k=k[None, :edge], v=v[None, :edge], q_len=np.array([edge]),
                         kv_len=np.array([edge]), causal=True)
  last = oracle.Problem(q=q[None, -edge:], k=k[None], v=v[None], q_len=np.array([edge]), kv_len=np.array([length]),
                        causal=True, bottom_right=True)
  for what, p, rows, keys in (("first rows", first, slice(0, edge), None),
                              ("last rows and keys", last, slice(length - edge, length), slice(-edge, None))):
    ref, naive = oracle.expected(p, DT, g[None, rows], np.ones((1, N, edge)))
    mine = dict(out=o[None, rows], lse=lse[None, :, rows], dq=dq[None, rows])
    names = ["out", "lse", "dq"]
    if keys is not None:
      mine.update(dk=dk[None, length - edge:length], dv=dv[None, length - edge:length])
      for name in ("dk", "dv"):
        ref[name], naive[name] = ref[name][:, keys], naive[name][:, keys]
      names += ["dk", "dv"]
    try:
      oracle.assert_close(mine, ref, naive, DT, names, accumulated=length)
    except AssertionError as e:
      raise AssertionError(f"long sequence, {what}: {e}") from e
