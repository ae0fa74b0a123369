"""CPU test of the CuTe kernel path: lowering for CUDA emits the FFI custom call with the right
operands, results and attributes (no GPU and no built library needed)."""

import re

import pytest

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import forward, library


@pytest.fixture(autouse=True)
def _default_variant_matrix(monkeypatch, tmp_path):
    """Judge support by the default build matrix, not by whatever library this machine has built."""
    monkeypatch.setenv("JAX_PADSAFE_CUTE_LIB", str(tmp_path / "absent.so"))
    library._load.cache_clear()
    yield
    library._load.cache_clear()


def _args(total_q=10, total_k=12, n=28, kh=4, h=128, b=2, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((total_q, n, h), dtype)
    k = jax.ShapeDtypeStruct((total_k, kh, h), dtype)
    cu = jax.ShapeDtypeStruct((b + 1,), jnp.int32)
    used = jax.ShapeDtypeStruct((b,), jnp.int32)
    return q, k, k, cu, cu, used, used


def _fwd(**kw):
    opts = dict(max_seqlen_q=6, max_seqlen_k=7, scale=0.125, causal=True, bottom_right=True,
                window_left=-1, window_right=-1, softcap=0.0)
    opts.update(kw)
    return lambda *a: forward.flash_forward(*a, **opts)


def _lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,tname", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16")])
@pytest.mark.parametrize("h", [64, 80, 96, 128, 192, 256])
def test_custom_call_operands(dtype, tname, h):
    text = _lower(_fwd(), *_args(h=h, dtype=dtype))
    calls = re.findall(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> \((.*?)\)", text)
    assert len(calls) == 1, text
    target, _, attrs, operands, results = calls[0]
    assert target == forward.TARGET_NAME == "jax_padsafe_fwd"
    assert [s.strip() for s in operands.split(",")] == [
        f"tensor<10x28x{h}x{tname}>", f"tensor<12x4x{h}x{tname}>", f"tensor<12x4x{h}x{tname}>",
        "tensor<3xi32>", "tensor<3xi32>", "tensor<2xi32>", "tensor<2xi32>", "tensor<0xf32>"]  # no sinks: [0]
    # o, lse, and the sm90 kernel's tile-counter scratch.
    assert [s.strip() for s in results.split(",")] == [f"tensor<10x28x{h}x{tname}>", "tensor<28x10xf32>",
                                                       "tensor<1xi32>"]
    for want in ("bottom_right = 1 : i32", "causal = 1 : i32", "max_seqlen_q = 6 : i32", "scale = 1.250000e-01 : f32",
                 "softcap = 0.000000e+00 : f32", "window_left = -1 : i32", "window_right = -1 : i32"):
        assert want in attrs, attrs


def test_sinks_operand():
    """The attention sinks travel as one float32 operand per query head, after the sequence bounds."""
    sinks = jax.ShapeDtypeStruct((28,), jnp.float32)
    text = _lower(lambda *a: _fwd()(*a[:7], a[7]), *_args(), sinks)
    operands = re.findall(r"stablehlo\.custom_call @jax_padsafe_fwd\((.*?)\) \{.*?\} : \((.*?)\)", text)
    assert len(operands) == 1, text
    assert operands[0][1].split(", ")[-1] == "tensor<28xf32>"
    with pytest.raises(ValueError, match="sinks must have shape"):
        _lower(lambda *a: _fwd()(*a[:7], a[7]), *_args(), jax.ShapeDtypeStruct((27,), jnp.float32))


def test_window_softcap_attributes():
    text = _lower(_fwd(causal=False, bottom_right=False, window_left=37, window_right=9, softcap=30.0), *_args())
    for want in ("causal = 0 : i32", "bottom_right = 0 : i32", "window_left = 37 : i32", "window_right = 9 : i32",
                 "softcap = 3.000000e+01 : f32"):
        assert want in text


def test_vmap_lowers_to_the_same_call():
    q, k, v, cu, cu2, used, used2 = _args()
    bq = jax.ShapeDtypeStruct((3,) + q.shape, q.dtype)
    f = jax.vmap(_fwd(), in_axes=(0, None, None, None, None, None, None))
    text = _lower(f, bq, k, v, cu, cu2, used, used2)
    assert "@jax_padsafe_fwd" in text


def test_bad_inputs_raise():
    q = jnp.zeros((10, 28, 128), jnp.bfloat16)
    k = jnp.zeros((12, 4, 128), jnp.bfloat16)
    cu = jnp.array([0, 4, 10], jnp.int32)
    used = jnp.array([3, 6], jnp.int32)
    with pytest.raises(ValueError):
        _fwd()(q, jnp.zeros((12, 5, 128), jnp.bfloat16), jnp.zeros((12, 5, 128), jnp.bfloat16), cu, cu, used, used)
    with pytest.raises(TypeError):
        _fwd()(q, k, k, cu.astype(jnp.int64) if jax.config.jax_enable_x64 else cu.astype(jnp.float32), cu, used, used)
    with pytest.raises(ValueError):
        _fwd()(q, k, k, cu, cu, jnp.array([3], jnp.int32), used)
    with pytest.raises(NotImplementedError):
        _fwd()(q[..., :88], k[..., :88], k[..., :88], cu, cu, used, used)
    with pytest.raises(NotImplementedError):
        _fwd()(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32), cu, cu, used, used)


def test_unsupported_reason():
    base = dict(dtype=jnp.bfloat16, head_dim=128, head_dim_v=128, num_heads=28, num_kv_heads=4, causal=True,
                window=None, softcap=0.0, aux=False)
    assert library.unsupported_reason(**base) is None
    assert library.unsupported_reason(**{**base, "dtype": jnp.float16}) is None
    assert library.unsupported_reason(**{**base, "aux": True}) is None  # masks and biases: the aux variants
    for bad in ({"dtype": jnp.float32}, {"head_dim": 320, "head_dim_v": 320}, {"head_dim_v": 264},
                {"aux": True, "softcap": 30.0}, {"num_kv_heads": 5}):
        reason = library.unsupported_reason(**{**base, **bad})
        assert isinstance(reason, str) and reason
    # Head dims between the built ones run zero-padded to the next built one; the raw kernel entry points
    # (exact=True) take the built ones only.
    for dims, width in (((88, 88), 96), ((8, 8), 64), ((72, 72), 80), ((200, 200), 256), ((192, 128), 192),
                        ((64, 96), 96)):
        assert library.unsupported_reason(**{**base, "head_dim": dims[0], "head_dim_v": dims[1]}) is None
        assert library.unsupported_reason(**{**base, "head_dim": dims[0], "head_dim_v": dims[1]},
                                          exact=True)
        assert library.kernel_head_dim(dtype=jnp.bfloat16, head_dim=dims[0], head_dim_v=dims[1]) == width
    assert library.kernel_head_dim(dtype=jnp.bfloat16, head_dim=264) is None


def test_library_available_never_raises(monkeypatch, tmp_path):
    assert isinstance(library.library_available(), bool)
    bogus = tmp_path / "nope.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv("JAX_PADSAFE_CUTE_LIB", str(bogus))
    library._load.cache_clear()
    assert library.library_available() is False


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("scale", [0.1, -0.1, 0.0])
def test_backward_lowers_to_one_call(scale, batched):
    """flash_backward lowers to one jax_padsafe_bwd custom call on the 11 operands (q, k, v, o, lse, dO, dlse and
    the four offset vectors), also under vmap (sequential) and for negative and zero scales."""
    from jax_padsafe._backends.cute import backward
    q = jnp.zeros((40, 4, 128), jnp.bfloat16)
    k = jnp.zeros((30, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((4, 40), jnp.float32)
    cu_q, cu_k = jnp.array([0, 20, 40], jnp.int32), jnp.array([0, 10, 30], jnp.int32)
    used = jnp.array([20, 10], jnp.int32)
    f = lambda q, k, v, o, l, do, dl: backward.flash_backward(  # noqa: E731
        q, k, v, o, l, do, dl, cu_q, cu_k, used, used, max_seqlen_q=20, max_seqlen_k=20, scale=scale, causal=True,
        bottom_right=True, window_left=8, window_right=-1, softcap=5.0, deterministic=True)
    args = (q, k, k, q, lse, q, lse)
    if batched:
        f, args = jax.vmap(f), tuple(jnp.stack([x, x]) for x in args)
    calls = [ln for ln in _lower(f, *args).splitlines() if "custom_call @jax_padsafe_bwd" in ln]
    assert len(calls) == 1, calls
    assert "deterministic = 1" in calls[0]
    operands = calls[0].rsplit(" : (", 1)[1].split(") -> (")[0]
    assert operands.count("tensor<") == 11, operands


def test_backward_rejects_float32():
    from jax_padsafe._backends.cute import backward
    q = jnp.zeros((40, 4, 128), jnp.float32)
    k = jnp.zeros((30, 2, 128), jnp.float32)
    lse = jnp.zeros((4, 40), jnp.float32)
    cu_q, cu_k = jnp.array([0, 20, 40], jnp.int32), jnp.array([0, 10, 30], jnp.int32)
    used = jnp.array([20, 10], jnp.int32)
    with pytest.raises(NotImplementedError):
        backward.flash_backward(q, k, k, q, lse, q, lse, cu_q, cu_k, used, used, max_seqlen_q=20, max_seqlen_k=20,
                                scale=0.1, causal=False, bottom_right=False, window_left=-1, window_right=-1,
                                softcap=0.0)
