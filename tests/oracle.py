"""The float64 NumPy oracle of the pad-safety contract, and its one accuracy rule.

Everything the test suite knows about the right answer lives here, written from the contract's text
and independently of the library (it imports nothing from ``jax_padsafe``):

* :class:`Problem` (padded layout ``[B, T, N, H]``) and :class:`PackedProblem` (packed layout with
  ``cu_seqlens`` / ``seqused``, reduced one sequence at a time to a one-row :class:`Problem`) say
  which rows are valid and which keys each query sees (:meth:`Problem.visible`: the contract's
  visibility rule, written once for the tests).
* :func:`reference` / :func:`reference_packed`: forward and gradients of the loss
  ``sum(out * d_out) + sum(lse * d_lse)`` from the textbook formulas on the valid data only, with the
  contract's additions: per-head sinks (``exp(sink_h)`` in every valid row's denominator, a key with a
  zero value, so that a valid row without keys has out 0 and lse = sink), ALiBi slopes (the score
  bias ``-slope * |i + off - j|``, added after the softcap like ``bias``) and a value head dim ``Hv``
  of its own. Every
  input is first copied into a fresh zero array through the validity masks, so poisoned padding
  cannot reach the oracle.  With ``lowp=dtype`` the same formulas give the *naive* attention of the
  accuracy rule: float32 arithmetic (float32 accumulation in every matrix product) with the results
  of each product rounded to ``dtype`` where a plain attention in that dtype holds them (scores,
  probabilities, output, dP, dS, gradients), as ``jax.nn.dot_product_attention`` in ``dtype`` does.
* :func:`expected`: both on the inputs exactly as the implementation receives them (rounded to its
  dtype), and :func:`assert_close`, the contract's rule

      max |ours - ref64| <= 2 * max |naive_lowp - ref64| + eps

  FlashAttention's tests use the same rule; their ``eps`` is twice the rounding error of the output
  dtype at the outputs' magnitude, and so is ours: ``eps = (2 * eps(out_dtype) + 32 * eps(float32))
  * max(1, max|ref64|)``, where ``out_dtype`` is the dtype the result is returned in (the input
  dtype for O and the gradients, float32 for lse and dbias) and the float32 term covers blockwise
  float32 accumulation in another order than the naive product's.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


def round_to(x, dtype):
  """``x`` as float64 holding exactly the values of ``x`` rounded to ``dtype`` (round to nearest even)."""
  return np.asarray(np.asarray(x, np.float64).astype(np.dtype(dtype)), np.float64)


@dataclasses.dataclass
class Problem:
  """A padded-layout problem in NumPy."""
  q: np.ndarray            # [B, T, N, H]
  k: np.ndarray            # [B, S, K, H]
  v: np.ndarray            # [B, S, K, Hv]
  q_len: np.ndarray        # [B]
  kv_len: np.ndarray       # [B]
  q_ids: np.ndarray | None = None   # [B, T]
  kv_ids: np.ndarray | None = None  # [B, S]
  bias: np.ndarray | None = None    # broadcastable [B, N, T, S] (head dim 1, K or N)
  mask: np.ndarray | None = None    # broadcastable [B, N, T, S] bool (head dim 1, K or N)
  causal: bool = False
  window: tuple | None = None       # (left, right), None side = unbounded
  softcap: float | None = None
  scale: float | None = None
  bottom_right: bool = False
  sinks: np.ndarray | None = None   # [N] sink logits
  alibi: np.ndarray | None = None   # [N] or [B, N] ALiBi slopes

  @property
  def shape(self):
    b, t, n, h = self.q.shape
    return b, t, n, h, self.k.shape[1], self.k.shape[2]

  def rounded(self, dtype):
    """The problem as an implementation sees it: q, k, v rounded to ``dtype``; a bias, sinks and
    slopes to float32."""
    f32 = lambda x: None if x is None else round_to(x, np.float32)  # noqa: E731
    return dataclasses.replace(self, q=round_to(self.q, dtype), k=round_to(self.k, dtype),
                               v=round_to(self.v, dtype), bias=f32(self.bias), sinks=f32(self.sinks),
                               alibi=f32(self.alibi))

  def offsets(self):
    """``[B]``: the offset ``off`` of query positions (``kv_len - q_len`` for bottom-right alignment)."""
    q_len, kv_len = np.asarray(self.q_len), np.asarray(self.kv_len)
    return (kv_len - q_len) if self.bottom_right else np.zeros_like(q_len)

  def alibi_bias(self):
    """``[B, N, T, S]`` float64: the ALiBi score bias ``-slope * |i + off - j|`` (None without slopes)."""
    if self.alibi is None:
      return None
    b, t, n, h, s, kh = self.shape
    slopes = np.broadcast_to(np.asarray(self.alibi, np.float64).reshape(-1, n), (b, n))
    i = np.arange(t)[None, :, None] + self.offsets()[:, None, None]
    dist = np.abs(i - np.arange(s)[None, None, :])
    return -slopes[:, :, None, None] * dist[:, None]

  def q_valid(self):
    b, t = self.q.shape[:2]
    valid = np.arange(t)[None, :] < np.asarray(self.q_len)[:, None]
    if self.q_ids is not None:
      valid &= self.q_ids >= 0
    return valid

  def k_valid(self):
    b, s = self.k.shape[:2]
    valid = np.arange(s)[None, :] < np.asarray(self.kv_len)[:, None]
    if self.kv_ids is not None:
      valid &= self.kv_ids >= 0
    return valid

  def visible(self):
    """[B, N, T, S] boolean: key j visible to query i (the contract's rule)."""
    b, t, n, h, s, kh = self.shape
    qv, kv = self.q_valid(), self.k_valid()
    vis = qv[:, :, None] & kv[:, None, :]
    if self.q_ids is not None:
      vis &= self.q_ids[:, :, None] == self.kv_ids[:, None, :]
    i = np.arange(t)[None, :, None] + self.offsets()[:, None, None]
    j = np.arange(s)[None, None, :]
    if self.causal:
      vis &= j <= i
    if self.window is not None:
      left, right = self.window
      if left is not None:
        vis &= j >= i - left
      if right is not None:
        vis &= j <= i + right
    vis = np.broadcast_to(vis[:, None], (b, n, t, s))
    if self.mask is not None:
      vis = vis & np.broadcast_to(per_query_head(self.mask, n), (b, n, t, s))
    if self.bias is not None:
      vis = vis & (np.broadcast_to(per_query_head(self.bias, n), (b, n, t, s)) != -np.inf)
    return vis


def per_query_head(x, n):
  """A mask or bias ``[Bx, Hx, Tx, Sx]`` given per key/value head (``1 < Hx < N``) as one entry per query
  head (query head ``h`` reads key/value head ``h // (N // Hx)``); other shapes unchanged."""
  if x is None or x.shape[1] in (1, n):
    return x
  return np.repeat(x, n // x.shape[1], axis=1)


def _clean(x, valid):
  out = np.zeros(x.shape, np.float64)
  out[valid] = np.asarray(x, np.float64)[valid]
  return out


def _rows(p: Problem, b, vis, q, k, v, bias, do, dl, lowp, sink=None):
  """Forward (and, with ``do``, backward) of batch row ``b``, heads first: q [N, T, H], k [K, S, H],
  v [K, S, Hv], do [N, T, Hv], vis [N, T, S], dl [N, T], sink [N] or None; float64, or float32 rounded
  to ``lowp`` as a plain attention in it.  ``bias`` holds every additive score term (bias and ALiBi)."""
  ft = np.float64 if lowp is None else np.float32
  rnd = (lambda x: x) if lowp is None else (lambda x: round_to(x, lowp).astype(ft))
  n, t, h = q.shape
  kh = k.shape[0]
  g = n // kh
  scale = p.scale if p.scale is not None else 1.0 / np.sqrt(h)
  # C-contiguous copies (the inputs are transposed views): NumPy hands those to BLAS.
  q, k, v = (np.ascontiguousarray(x, ft) for x in (q, np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)))
  s = rnd(np.matmul(q, k.transpose(0, 2, 1))) * ft(scale)
  th = None
  if p.softcap is not None:
    th = np.tanh(s / ft(p.softcap))
    s = ft(p.softcap) * th
  if bias is not None:
    s = s + np.where(vis, bias, 0.0).astype(ft)
  # A row has a softmax iff it sees a key or has a sink (a logit of its own, with a zero value).
  mx = np.where(vis, s, -np.inf).max(-1, initial=-np.inf)
  sk = None if sink is None else np.asarray(sink, ft)[:, None]      # [N, 1]
  if sk is not None:
    mx = np.maximum(mx, sk)
  has = mx != -np.inf
  mx = np.where(has, mx, 0.0).astype(ft)
  with np.errstate(over="ignore"):  # hidden entries may overflow; the select drops them
    e = np.where(vis, np.exp(np.where(vis, s, 0.0) - mx[..., None]), 0.0).astype(ft)
    e_sink = 0.0 if sk is None else np.where(has, np.exp(np.where(has, sk, 0.0) - mx), 0.0).astype(ft)
  l = np.where(has, e.sum(-1) + e_sink, 1.0).astype(ft)
  prob = e / l[..., None]
  prob_lp = rnd(prob)
  out = rnd(np.matmul(prob_lp, v))
  lse = np.where(has, mx + np.log(l), -np.inf)
  res = dict(out=out, lse=lse)
  if do is None:
    return res
  do = np.ascontiguousarray(do, ft)
  fold = lambda x: x.reshape(kh, g, *x.shape[1:]).sum(1)  # noqa: E731  (query heads -> their kv head)
  dp = rnd(np.matmul(do, v.transpose(0, 2, 1)))
  delta = np.where(has, (prob * dp).sum(-1) - dl, 0.0).astype(ft)
  ds = np.where(vis, prob * (dp - delta[..., None]), 0.0).astype(ft)
  res["ds_logits"] = ds
  if sk is not None:  # d lse / d sink = P_sink, d out / d sink = -P_sink * out: dsink = -P_sink * Delta
    res["dsink_rows"] = -(e_sink / l) * delta
  if th is not None:
    ds = ds * (1 - th * th)
  ds = rnd(ds * ft(scale))
  res["dq"] = rnd(np.matmul(ds, k))
  res["dk"] = rnd(fold(np.matmul(ds.transpose(0, 2, 1), q)))
  res["dv"] = rnd(fold(np.matmul(prob_lp.transpose(0, 2, 1), do)))
  return res


def reference(p: Problem, d_out=None, d_lse=None, *, lowp=None):
  """``dict(out, lse, visible, empty, seen[, dq, dk, dv, dbias, dsinks])`` of ``p``, float64 arrays.

  ``out`` [B, T, N, Hv], ``dq`` [B, T, N, H], ``lse`` [B, N, T], ``dk`` [B, S, K, H], ``dv`` [B, S, K, Hv],
  ``dbias`` the bias' shape, ``dsinks`` [N] (None without sinks).  Padded rows are exactly 0 (lse too);
  valid rows that see no key have out 0, lse -inf (the sink with sinks), dq 0.
  ``empty`` [B, N, T]: valid rows with no visible key; ``seen`` [B, S, K]: keys some valid query sees.
  ``lowp``: the naive attention in that dtype instead of float64 (see the module docstring)."""
  b, t, n, h, s, kh = p.shape
  hv = p.v.shape[-1]
  qv, kv = p.q_valid(), p.k_valid()
  q, k, v = _clean(p.q, qv), _clean(p.k, kv), _clean(p.v, kv)
  vis = p.visible()
  sinks = None if p.sinks is None else np.asarray(p.sinks, np.float64)
  grads = d_out is not None
  if grads:
    do = _clean(d_out, qv)
    dl = np.zeros((b, n, t)) if d_lse is None else np.where(qv[:, None, :], np.asarray(d_lse, np.float64), 0.0)
  bias = None if p.bias is None else np.broadcast_to(per_query_head(np.asarray(p.bias, np.float64), n), (b, n, t, s))
  alibi = p.alibi_bias()
  if alibi is not None:
    bias = alibi if bias is None else bias + alibi
  out = np.zeros((b, t, n, hv))
  lse = np.zeros((b, n, t))
  if grads:
    dq, dk, dv = np.zeros((b, t, n, h)), np.zeros((b, s, kh, h)), np.zeros((b, s, kh, hv))
    ds_logits = np.zeros((b, n, t, s))
    dsinks = None if sinks is None else np.zeros(n)
  heads = lambda x: x.transpose(1, 0, 2)  # noqa: E731  [rows, heads, H] <-> [heads, rows, H]
  for r in range(b):
    # Rows and keys at or past the lengths are padding: the row's work is its valid rectangle only.
    tq, ts = (int(np.clip(x[r], 0, m)) for x, m in ((np.asarray(p.q_len), t), (np.asarray(p.kv_len), s)))
    if tq == 0:
      continue
    qs, ks = slice(0, tq), slice(0, ts)
    res = _rows(p, r, vis[r][:, qs, ks], heads(q[r, qs]), heads(k[r, ks]), heads(v[r, ks]),
                None if bias is None else bias[r][:, qs, ks], heads(do[r, qs]) if grads else None,
                dl[r][:, qs] if grads else None, lowp, sinks)
    out[r, qs] = heads(res["out"])
    lse[r][:, qs] = np.where(qv[r][None, qs], res["lse"], 0.0)
    if grads:
      dq[r, qs], dk[r, ks], dv[r, ks] = heads(res["dq"]), heads(res["dk"]), heads(res["dv"])
      ds_logits[r][:, qs, ks] = res["ds_logits"]
      if sinks is not None:  # valid rows only: a row with a negative segment id is padding
        dsinks += np.where(qv[r][None, qs], res["dsink_rows"], 0.0).sum(-1)
  empty = qv[:, None, :] & ~vis.any(-1)
  seen = vis.reshape(b, kh, n // kh, t, s).any(axis=(2, 3)).transpose(0, 2, 1)
  result = dict(out=out, lse=lse, visible=vis, empty=empty, seen=seen)
  if grads:
    dbias = None
    if p.bias is not None:
      dbias = ds_logits
      hx = p.bias.shape[1]
      if 1 < hx < n:  # per key/value head: the sum over each group's query heads
        dbias = dbias.reshape(b, hx, n // hx, t, s).sum(axis=2)
      for axis in range(4):
        if p.bias.shape[axis] == 1:
          dbias = dbias.sum(axis=axis, keepdims=True)
      if lowp is not None:  # the naive attention's dbias is float32 (summed over broadcast dims in float32)
        dbias = round_to(dbias, np.float32)
    if dsinks is not None and lowp is not None:
      dsinks = round_to(dsinks, np.float32)
    result.update(dq=dq, dk=dk, dv=dv, dbias=dbias, dsinks=dsinks)
  return result


@dataclasses.dataclass
class PackedProblem:
  """A packed-layout problem: sequence b owns rows ``cu_q[b] .. cu_q[b] + used_q[b] - 1`` of q (and
  likewise of k, v); every other row (a sequence's unused rows, rows before ``cu[0]`` or at and past
  ``cu[-1]``) is padding."""
  q: np.ndarray            # [total_q, N, H]
  k: np.ndarray            # [total_k, K, H]
  v: np.ndarray            # [total_k, K, Hv]
  cu_q: np.ndarray         # [B + 1]
  cu_k: np.ndarray         # [B + 1]
  used_q: np.ndarray       # [B]
  used_k: np.ndarray       # [B]
  causal: bool = False
  window: tuple | None = None
  softcap: float | None = None
  scale: float | None = None
  bottom_right: bool = False
  sinks: np.ndarray | None = None   # [N]
  alibi: np.ndarray | None = None   # [N] or [B, N] (one row of slopes per sequence)

  def rounded(self, dtype):
    f32 = lambda x: None if x is None else round_to(x, np.float32)  # noqa: E731
    return dataclasses.replace(self, q=round_to(self.q, dtype), k=round_to(self.k, dtype),
                               v=round_to(self.v, dtype), sinks=f32(self.sinks), alibi=f32(self.alibi))

  def _alibi_of(self, b):
    if self.alibi is None:
      return None
    alibi = np.asarray(self.alibi)
    return alibi if alibi.ndim == 1 else alibi[b]

  def _valid(self, cu, used, total):
    valid = np.zeros(total, bool)
    for b in range(len(used)):
      valid[cu[b]:cu[b] + used[b]] = True
    return valid

  def q_valid(self):
    return self._valid(self.cu_q, self.used_q, self.q.shape[0])

  def k_valid(self):
    return self._valid(self.cu_k, self.used_k, self.k.shape[0])

  def q_rows(self, b):
    return slice(int(self.cu_q[b]), int(self.cu_q[b]) + int(self.used_q[b]))

  def k_rows(self, b):
    return slice(int(self.cu_k[b]), int(self.cu_k[b]) + int(self.used_k[b]))

  def sequence(self, b) -> Problem:
    """Sequence b's valid rows as a padded problem of one batch row."""
    qs, ks = self.q_rows(b), self.k_rows(b)
    return Problem(q=self.q[qs][None], k=self.k[ks][None], v=self.v[ks][None],
                   q_len=np.array([qs.stop - qs.start]), kv_len=np.array([ks.stop - ks.start]),
                   causal=self.causal, window=self.window, softcap=self.softcap, scale=self.scale,
                   bottom_right=self.bottom_right, sinks=self.sinks, alibi=self._alibi_of(b))

  def padded(self) -> Problem:
    """All sequences as one padded problem (batch row b = sequence b, padded to the longest)."""
    nseq = len(self.used_q)
    t, s = max(1, int(np.max(self.used_q, initial=0))), max(1, int(np.max(self.used_k, initial=0)))
    n, h = self.q.shape[1:]
    kh, hv = self.k.shape[1], self.v.shape[-1]
    q, k, v = np.zeros((nseq, t, n, h)), np.zeros((nseq, s, kh, h)), np.zeros((nseq, s, kh, hv))
    for b in range(nseq):
      qs, ks = self.q_rows(b), self.k_rows(b)
      q[b, :qs.stop - qs.start] = self.q[qs]
      k[b, :ks.stop - ks.start] = self.k[ks]
      v[b, :ks.stop - ks.start] = self.v[ks]
    alibi = None
    if self.alibi is not None:
      alibi = np.broadcast_to(np.asarray(self.alibi).reshape(-1, n), (nseq, n))
    return Problem(q=q, k=k, v=v, q_len=np.asarray(self.used_q), kv_len=np.asarray(self.used_k),
                   causal=self.causal, window=self.window, softcap=self.softcap, scale=self.scale,
                   bottom_right=self.bottom_right, sinks=self.sinks, alibi=alibi)


def reference_packed(pp: PackedProblem, d_out=None, d_lse=None, *, lowp=None):
  """:func:`reference` in the packed layout, one sequence at a time: ``out`` [total_q, N, Hv], ``dq``
  [total_q, N, H], ``lse``/``empty`` [N, total_q], ``dk`` [total_k, K, H], ``dv`` [total_k, K, Hv], ``seen``
  [total_k, K], ``dsinks`` [N] (summed over the sequences; None without sinks)."""
  total_q, n, h = pp.q.shape
  total_k, kh = pp.k.shape[:2]
  hv = pp.v.shape[-1]
  res = dict(out=np.zeros((total_q, n, hv)), lse=np.zeros((n, total_q)), empty=np.zeros((n, total_q), bool),
             seen=np.zeros((total_k, kh), bool))
  if d_out is not None:
    res.update(dq=np.zeros((total_q, n, h)), dk=np.zeros((total_k, kh, h)), dv=np.zeros((total_k, kh, hv)),
               dsinks=None if pp.sinks is None else np.zeros(n))
  for b in range(len(pp.used_q)):
    qs, ks = pp.q_rows(b), pp.k_rows(b)
    if qs.stop == qs.start:
      continue
    p = pp.sequence(b)
    r = reference(p, None if d_out is None else d_out[qs][None],
                  None if d_lse is None else d_lse[:, qs][None], lowp=lowp)
    res["out"][qs], res["lse"][:, qs], res["empty"][:, qs] = r["out"][0], r["lse"][0], r["empty"][0]
    res["seen"][ks] = r["seen"][0]
    if d_out is not None:
      res["dq"][qs], res["dk"][ks], res["dv"][ks] = r["dq"][0], r["dk"][0], r["dv"][0]
      if pp.sinks is not None:
        res["dsinks"] += r["dsinks"]
  if lowp is not None and res.get("dsinks") is not None:
    res["dsinks"] = round_to(res["dsinks"], np.float32)
  return res


def expected(p, dtype, d_out=None, d_lse=None):
  """``(ref64, naive)`` for a :class:`Problem` or :class:`PackedProblem` run in ``dtype``: both computed
  on the inputs as the implementation receives them (q, k, v and d_out rounded to ``dtype``, d_lse
  and a bias to float32)."""
  p = p.rounded(dtype)
  do = None if d_out is None else round_to(d_out, dtype)
  dl = None if d_lse is None else round_to(d_lse, np.float32)
  fn = reference_packed if isinstance(p, PackedProblem) else reference
  return fn(p, do, dl), fn(p, do, dl, lowp=dtype)


# The dtype each result is returned in, where it is not the input dtype.
_FLOAT32_RESULTS = ("lse", "dbias", "dsinks")


def assert_close(ours, ref, naive, dtype, names, accumulated=1024, out_dtypes=None):
  """The contract's accuracy rule, ``max|ours - ref64| <= 2 * max|naive_lowp - ref64| + eps``, over the
  finite reference entries of each result in ``names``; non-finite entries (lse = -inf of valid rows
  without keys) must match exactly.

  ``eps`` is two roundings of the output dtype plus the float32 rounding of a long sum: the naive
  attention's row sums are NumPy's pairwise sums (error ~ log2(n) eps), while a flash kernel adds a row's
  keys one tile after another (error ~ sqrt(n) eps), so the float32 term is ``sqrt(accumulated)`` eps,
  ``accumulated`` being the most keys one row sums (the default covers rows of up to 1024 keys).
  ``out_dtypes``: the dtype of a result returned in neither the input dtype nor float32 (e.g. dbias
  of a bfloat16 bias), by name."""
  for name in names:
    r = np.asarray(ref[name], np.float64)
    a = np.asarray(ours[name], np.float64)
    assert a.shape == r.shape, f"{name}: shape {a.shape}, expected {r.shape}"
    finite = np.isfinite(r)
    assert np.array_equal(np.isfinite(a), finite), f"{name}: non-finite entries differ from the oracle"
    assert np.array_equal(a[~finite], r[~finite]), f"{name}: infinite entries differ from the oracle"
    if not finite.any():
      continue
    err = np.max(np.abs(a[finite] - r[finite]))
    naive_err = np.max(np.abs(np.asarray(naive[name], np.float64)[finite] - r[finite]))
    out_dtype = (out_dtypes or {}).get(name, np.float32 if name in _FLOAT32_RESULTS else dtype)
    eps = (2 * float(ml_dtypes.finfo(out_dtype).eps)
           + max(32.0, float(np.sqrt(accumulated))) * float(np.finfo(np.float32).eps)) * max(
        1.0, float(np.max(np.abs(r[finite]))))
    assert err <= 2 * naive_err + eps, (
        f"{name}: max error {err:.3g} > 2 * naive {naive_err:.3g} + eps {eps:.3g}")
