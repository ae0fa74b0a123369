"""CPU tests of the forward build matrix and the registry the FFI handler selects from (no GPU, no DSL)."""

from jax_padsafe.kernels import build, variants as V


def test_default_matrix():
    vs = V.matrix(sm90=True)
    by_family = {}
    for v in vs:
        by_family.setdefault(v.family, []).append(v)
    assert set(by_family) == {"sm80", "sm90"}
    assert len(by_family["sm80"]) == len(V.ARCHS) * len(V.DTYPES) * len(V.HEAD_DIMS) * len(V.SOFTCAP)
    assert {(v.arch, v.dtype, v.head_dim, v.softcap) for v in by_family["sm90"]} == {
        ("sm_90a", d, h, c) for d in V.DTYPES for h in V.SM90_TILES for c in V.SOFTCAP}
    assert all(v.tile == V.SM90_TILES[v.head_dim] for v in by_family["sm90"])
    assert all(v.tile == V.TILES[v.head_dim] for v in by_family["sm80"])
    assert len({v.prefix for v in vs}) == len(vs)  # every export has its own symbol prefix
    assert V.FwdVariant("sm_90a", "bf16", 128, False, "sm90").prefix == "jps_fwd_sm90k_sm_90a_bf16_hd128_nocap"
    assert V.FwdVariant("sm_80", "fp16", 64, True).prefix == "jps_fwd_sm_80_fp16_hd64_cap"
    assert all(v.family == "sm80" for v in V.matrix(archs=("sm_80",), sm90=True))  # the Hopper family: sm_90a only


def test_registry_rows(tmp_path):
    """The generated table carries what the handler selects on: arch, dtype, head dim, softcap, block_m, family."""
    vs = [V.FwdVariant("sm_90a", "bf16", 128, False, "sm80"), V.FwdVariant("sm_90a", "fp16", 256, True, "sm90")]
    build.write_registry(str(tmp_path), vs)
    text = (tmp_path / "jps_registry.h").read_text()
    rows = [ln.strip().rstrip(",").strip("{}").split(",") for ln in text.splitlines() if ln.startswith("  {90,")]
    assert [[f.strip() for f in (r[:5] + r[-1:])] for r in rows] == [
        ["90", "0", "128", "0", str(V.TILES[128][0]), "0"], ["90", "1", "256", "1", str(V.SM90_TILES[256][0]), "1"]]
    assert f"static const int kJpsNumFwdVariants = {len(vs)};" in text
    assert (tmp_path / "objects.txt").read_text().split() == [v.prefix + ".o" for v in vs]


def test_zero_rows_registry(tmp_path):
    """The row-zeroing kernels: built with the sm90 family only (sm_90a, one and two outputs), listed in objects.txt
    next to the variants, and a table the handlers search by (arch, outputs); without them the table is empty
    (one placeholder row, count 0), so ffi/jps_zero_rows.cc still compiles and the handlers keep their memsets."""
    zs = V.zero_rows_kernels(sm90=True)
    assert [(z.arch, z.num_outputs, z.prefix) for z in zs] == [
        ("sm_90a", 1, "jps_zero_rows1_sm_90a"), ("sm_90a", 2, "jps_zero_rows2_sm_90a")]
    assert V.zero_rows_kernels(sm90=False) == [] and V.zero_rows_kernels(archs=("sm_80",), sm90=True) == []
    vs = [V.FwdVariant("sm_90a", "bf16", 128, False, "sm90")]
    build.write_registry(str(tmp_path), vs, extra_objects=zs)
    assert (tmp_path / "objects.txt").read_text().split() == [v.prefix + ".o" for v in vs + zs]
    build.write_zero_rows_registry(str(tmp_path), zs)
    text = (tmp_path / "jps_zero_rows_registry.h").read_text()
    assert "{90, 1, &jps_zero_rows1_sm_90a_module, &jps_zero_rows1_sm_90a_load, &jps_zero_rows1_sm_90a_launch}," in text
    assert "{90, 2, &jps_zero_rows2_sm_90a_module" in text
    assert "static const int kJpsNumZeroRowsKernels = 2;" in text
    build.write_zero_rows_registry(str(tmp_path), [])
    text = (tmp_path / "jps_zero_rows_registry.h").read_text()
    assert "{0, 0, 0, 0, 0}," in text and "static const int kJpsNumZeroRowsKernels = 0;" in text


def test_adapters_pass_the_tile_counter_to_the_sm90_family_only(tmp_path):
    """The sm90 forward takes one more tensor than the SM80-class one (its compact schedule's tile counter): its
    adapter checks that parameter's ABI and passes JpsFwdArgs.tile_counter; the SM80-class adapter passes none."""
    sm80, sm90 = V.FwdVariant("sm_90a", "bf16", 128, False, "sm80"), V.FwdVariant("sm_90a", "bf16", 128, False, "sm90")
    build.write_registry(str(tmp_path), [sm80, sm90])
    text = (tmp_path / "jps_registry.h").read_text()
    adapters = {v.prefix: text[text.index(f'#include "{v.prefix}.h"'):text.index(f"static {v.prefix}_Kernel_Module_t")]
                for v in (sm80, sm90)}
    a80, a90 = adapters[sm80.prefix], adapters[sm90.prefix]
    assert f"{sm90.prefix}_Tensor_mTileCounter_t tc = {{a->tile_counter, {{1}}}};" in a90
    assert "&uq, &uk, &tc," in a90 and f'"ABI of {sm90.prefix}.mTileCounter"' in a90
    assert "tile_counter" not in a80 and "mTileCounter" not in a80 and "&uq, &uk,\n" in a80


def test_backward_adapters_pass_tile_counters_to_the_sm90_family_only(tmp_path, monkeypatch):
    """Both sm90 backward kernels take one more tensor than the other families' (their compact schedule's tile
    counter: the dK/dV kernel JpsBwdArgs.tile_counters[0], the dQ kernel [1]), right after seqused_k; the registry
    row also carries their tiles (dK/dV block_n, dQ block_m) and which of them queue every layout, from which the
    handler decides whether to zero the counters.  The SM80-class and fused-dQ families pass no counter and carry zeros."""
    from jax_padsafe.kernels import bwd_build as BB
    for var in ("JPS_SM90_BWD_DENSE_QUEUE", "JPS_SM90_BWD_QUEUE"):
        monkeypatch.delenv(var, raising=False)
    fams = {f: BB.BwdVariant("sm_90a", "bf16", 128, False, f) for f in ("sm80", "sm90", "sm90f")}
    BB.write_registry(str(tmp_path), list(fams.values()))
    text = (tmp_path / "jps_bwd_registry.h").read_text()

    def adapter(v, kind):
        p = f"{v.prefix}_{kind}"
        return text[text.index(f'#include "{p}.h"'):text.index(f"static {p}_Kernel_Module_t")]

    sm90 = fams["sm90"]
    for kind, ptr in (("dkdv", "a->tile_counters"), ("dq", "a->tile_counters + 1")):
        a = adapter(sm90, kind)
        assert f"{sm90.prefix}_{kind}_Tensor_mTileCounter_t mTileCounter = {{{ptr}, {{1}}}};" in a
        assert "&mUsedK, &mTileCounter, a->score_mul" in a
    assert "mTileCounter" not in adapter(sm90, "pre")
    for f in ("sm80", "sm90f"):
        for kind in fams[f].kinds:
            assert "tile_counters" not in adapter(fams[f], kind)
    rows = {v.prefix: next(line for line in text.splitlines() if f'"{v.prefix}"' in line) for v in fams.values()}
    # hd128: both kernels queue every layout (queue_all = 3), so every call zeroes the counters.
    assert rows[sm90.prefix].endswith('"%s", 1, 0, 0, 128, 128, 3},' % sm90.prefix)
    for f in ("sm80", "sm90f"):
        assert rows[fams[f].prefix].endswith(", 0, 0, 0, 0, 0},")
    # The bits the build read off the compiled kernels (`_compile_one`) win over the policy table, so the row
    # always describes the kernels that were linked, whatever the environment the table was evaluated in.
    hd96 = BB.BwdVariant("sm_90a", "bf16", 96, False, "sm90")
    BB.write_registry(str(tmp_path), [sm90, hd96], {sm90.prefix: 1, hd96.prefix: 2})
    text = (tmp_path / "jps_bwd_registry.h").read_text()
    rows = {v.prefix: next(line for line in text.splitlines() if f'"{v.prefix}"' in line) for v in (sm90, hd96)}
    assert rows[sm90.prefix].endswith(", 128, 128, 1},") and rows[hd96.prefix].endswith(", 2},")


def test_dense_queue_policy(monkeypatch):
    """Which sm90 backward kernels queue every layout (`queue_dense`, the registry's queue_all): the measured
    table by default, nothing with JPS_SM90_BWD_DENSE_QUEUE=0 or without the queue, everything with =all."""
    from jax_padsafe.kernels import bwd_build as BB
    monkeypatch.delenv("JPS_SM90_BWD_DENSE_QUEUE", raising=False)
    monkeypatch.delenv("JPS_SM90_BWD_QUEUE", raising=False)
    for hd in (64, 96, 128, 192, 256):
        assert BB.sm90_dense_queue(hd) == (hd in BB.SM90_DENSE_QUEUE["dkdv"], hd in BB.SM90_DENSE_QUEUE["dq"])
    assert BB.sm90_dense_queue(128) == (True, True) and BB.sm90_dense_queue(64) == (False, True)
    assert BB.sm90_dense_queue(96) == (False, False) and BB.sm90_dense_queue(256) == (True, True)
    monkeypatch.setenv("JPS_SM90_BWD_DENSE_QUEUE", "all")
    assert BB.sm90_dense_queue(256) == (True, True)
    monkeypatch.setenv("JPS_SM90_BWD_QUEUE", "0")
    assert BB.sm90_dense_queue(128) == (False, False)
    monkeypatch.setenv("JPS_SM90_BWD_QUEUE", "1")
    monkeypatch.setenv("JPS_SM90_BWD_DENSE_QUEUE", "0")
    assert BB.sm90_dense_queue(128) == (False, False)
