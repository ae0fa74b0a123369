"""CPU tests of the build matrix and the registries the FFI handlers select from (no GPU, no DSL)."""

from jax_padsafe.kernels.build import cache, registry, variants as V


def test_default_matrix():
    vs = V.matrix(kinds=("fwd",))
    by_family = {}
    for v in vs:
        by_family.setdefault(v.family, []).append(v)
    assert set(by_family) == {"sm80", "sm90"}
    # Per (arch, dtype, head dim): softcap off and on, and the two aux kinds (softcap off only).
    per_dim = len(V.SOFTCAP) + len(V.AUX_KINDS)
    assert len(by_family["sm80"]) == len(V.ARCHS) * len(V.DTYPES) * len(V.HEAD_DIMS) * per_dim
    assert {(v.arch, v.dtype, v.head_dim, v.softcap, v.aux) for v in by_family["sm90"]} == {
        ("sm_90a", d, h, c, "") for d in V.DTYPES for h in V.TUNING["sm90"] for c in V.SOFTCAP} | {
        ("sm_90a", d, h, False, k) for d in V.DTYPES for h in V.TUNING["sm90"] for k in V.AUX_KINDS}
    assert not any(v.aux for v in V.matrix(aux=(False,)))
    assert all(v.aux and not v.softcap for v in V.matrix(aux=(True,)))
    assert all(v.tile == V.TUNING["sm90"][v.head_dim].fwd for v in by_family["sm90"])
    assert all(v.tile == V.TUNING["sm80"][v.head_dim].fwd for v in by_family["sm80"])
    both = V.matrix() + V.zero_rows_kernels()
    assert len(both) == 2 * len(vs) + 2 and {v.kind for v in both} == {"fwd", "bwd", "zero_rows"}
    exports = [e for v in both for e in v.exports]
    assert len(set(exports)) == len(exports)  # every export has its own symbol prefix
    assert V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm90").prefix == "jps_fwd_sm90k_sm_90a_bf16_hd128_nocap"
    assert V.Variant("fwd", "sm_80", "fp16", 64, True).prefix == "jps_fwd_sm_80_fp16_hd64_cap"
    assert V.Variant("fwd", "sm_90a", "bf16", 64, False, "sm90", "mask").prefix == \
        "jps_fwd_sm90k_sm_90a_bf16_hd64_nocap_mask"
    assert V.Variant("bwd", "sm_80", "bf16", 256, False).exports == tuple(
        f"jps_bwd_sm_80_bf16_hd256_nocap_{k}" for k in ("pre", "dv", "dk", "dq"))
    assert all(v.family == "sm80" for v in V.matrix(archs=("sm_80",)))  # the Hopper family: sm_90a only


def test_registry_rows(tmp_path):
    """The generated table carries what the handler selects on: arch, dtype, head dim, softcap, block_m, family,
    aux kind (0 plain, 1 mask, 2 bias)."""
    vs = [V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm80"), V.Variant("fwd", "sm_90a", "fp16", 256, True, "sm90"),
          V.Variant("fwd", "sm_90a", "bf16", 64, False, "sm90", "mask"),
          V.Variant("fwd", "sm_90a", "bf16", 64, False, "sm80", "bias")]
    registry.write(str(tmp_path), vs)
    text = (tmp_path / "jps_registry.h").read_text()
    rows = [ln.strip().rstrip(",").strip("{}").split(",") for ln in text.splitlines() if ln.startswith("  {90,")]
    assert [[f.strip() for f in (r[:5] + r[-2:])] for r in rows] == [
        ["90", "0", "128", "0", str(V.TUNING["sm80"][128].fwd[0]), "0", "0"],
        ["90", "1", "256", "1", str(V.TUNING["sm90"][256].fwd[0]), "1", "0"],
        ["90", "0", "64", "0", str(V.TUNING["sm90"][64].fwd[0]), "1", "1"],
        ["90", "0", "64", "0", str(V.TUNING["sm80"][64].fwd[0]), "0", "2"]]
    assert f"static const int kJpsNumFwdVariants = {len(vs)};" in text
    assert (tmp_path / "objects.txt").read_text().split() == [v.prefix + ".o" for v in vs]


def test_zero_rows_registry(tmp_path):
    """The row-zeroing kernels: built with the sm90 family only (sm_90a, one and two outputs), listed in objects.txt
    next to the variants, and a table the handlers search by (arch, outputs); without them the table is empty
    (one placeholder row, count 0), so ffi/jps_zero_rows.cc still compiles and the handlers keep their memsets."""
    zs = V.zero_rows_kernels()
    assert [(z.arch, z.num_outputs, z.prefix) for z in zs] == [
        ("sm_90a", 1, "jps_zero_rows1_sm_90a"), ("sm_90a", 2, "jps_zero_rows2_sm_90a")]
    assert V.zero_rows_kernels(archs=("sm_80",)) == []
    vs = [V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm90")]
    registry.write(str(tmp_path), vs + zs)
    assert (tmp_path / "objects.txt").read_text().split() == [v.prefix + ".o" for v in vs + zs]
    text = (tmp_path / "jps_zero_rows_registry.h").read_text()
    assert "{90, 1, &jps_zero_rows1_sm_90a_module, &jps_zero_rows1_sm_90a_load, &jps_zero_rows1_sm_90a_launch}," in text
    assert "{90, 2, &jps_zero_rows2_sm_90a_module" in text
    assert "static const int kJpsNumZeroRowsKernels = 2;" in text
    registry.write(str(tmp_path), [])
    text = (tmp_path / "jps_zero_rows_registry.h").read_text()
    assert "{0, 0, 0, 0, 0}," in text and "static const int kJpsNumZeroRowsKernels = 0;" in text


def test_adapters_pass_the_tile_counter_to_the_sm90_family_only(tmp_path):
    """The sm90 forward takes one more tensor than the SM80-class one (its compact schedule's tile counter): its
    adapter checks that parameter's ABI and passes JpsFwdArgs.tile_counter; the SM80-class adapter passes none."""
    sm80, sm90 = (V.Variant("fwd", "sm_90a", "bf16", 128, False, f) for f in ("sm80", "sm90"))
    registry.write(str(tmp_path), [sm80, sm90])
    text = (tmp_path / "jps_registry.h").read_text()
    adapters = {v.prefix: text[text.index(f'#include "{v.prefix}.h"'):text.index(f"static {v.prefix}_Kernel_Module_t")]
                for v in (sm80, sm90)}
    a80, a90 = adapters[sm80.prefix], adapters[sm90.prefix]
    assert f"{sm90.prefix}_Tensor_mTileCounter_t tc = {{a->tile_counter, {{1}}}};" in a90
    assert "&uq, &uk, &tc," in a90 and f'"ABI of {sm90.prefix}.mTileCounter"' in a90
    assert "tile_counter" not in a80 and "mTileCounter" not in a80 and "&uq, &uk,\n" in a80


def test_backward_adapters_pass_tile_counters_to_the_sm90_family_only(tmp_path):
    """Both sm90 backward kernels take one more tensor than the other families' (their compact schedule's tile
    counter: the dK/dV kernel JpsBwdArgs.tile_counters[0], the dQ kernel [1]), right after seqused_k; the registry
    row also carries their tiles (dK/dV block_n, dQ block_m) and which of them queue every layout, from which the
    handler decides whether to zero the counters.  The SM80-class family passes no counter and carries zeros."""
    fams = {f: V.Variant("bwd", "sm_90a", "bf16", 128, False, f) for f in ("sm80", "sm90")}
    registry.write(str(tmp_path), list(fams.values()))
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
    for kind in fams["sm80"].kernels:
        assert "tile_counters" not in adapter(fams["sm80"], kind)
    rows = {v.prefix: next(line for line in text.splitlines() if f'"{v.prefix}"' in line) for v in fams.values()}
    # hd128: both kernels queue every layout (queue_all = 3), so every call zeroes the counters.
    assert rows[sm90.prefix].endswith('"%s", 1, 0, 0, 128, 128, 3, 0, 0, 0},' % sm90.prefix)
    assert rows[fams["sm80"].prefix].endswith(", 0, 0, 0, 0, 0, 0, 0, 0},")
    # The bits the build read off the compiled kernels (`families.compile_variant`) win over the tuning table, so
    # the row always describes the kernels that were linked.
    hd96 = V.Variant("bwd", "sm_90a", "bf16", 96, False, "sm90")
    registry.write(str(tmp_path), [sm90, hd96], {sm90.prefix: 1, hd96.prefix: 2})
    text = (tmp_path / "jps_bwd_registry.h").read_text()
    rows = {v.prefix: next(line for line in text.splitlines() if f'"{v.prefix}"' in line) for v in (sm90, hd96)}
    assert rows[sm90.prefix].endswith(", 128, 128, 1, 0, 0, 0},") and rows[hd96.prefix].endswith(", 2, 0, 0, 0},")


def test_bias_variants_carry_the_bias_gradient_kernel(tmp_path):
    """The "bias" kind's backward exports the bias gradient kernel after dQ, and its registry row points at it;
    the other kinds carry null there."""
    for fam in ("sm80", "sm90"):
        bias = V.Variant("bwd", "sm_90a", "bf16", 128, False, fam, "bias")
        mask = V.Variant("bwd", "sm_90a", "bf16", 128, False, fam, "mask")
        assert bias.kernels[-1] == "dbias" and "dbias" not in mask.kernels
        assert bias.options["dbias"] == V.dbias_tile("sm_90a", 128, fam)
        registry.write(str(tmp_path), [mask, bias])
        text = (tmp_path / "jps_bwd_registry.h").read_text()
        row = next(line for line in text.splitlines() if f'"{bias.prefix}"' in line)
        assert row.endswith(f", 2, &{bias.prefix}_dbias_module, &{bias.prefix}_dbias_launch}},")
        row = next(line for line in text.splitlines() if f'"{mask.prefix}"' in line)
        assert row.endswith(", 1, 0, 0},")
        assert f"{bias.prefix}_dbias_Tensor_mdBias32_t dbias32 = {{a->dbias32, {{a->dbias32_dims[0]" in text
    # SM80-class kernel: two stages of Q, dO, K and V where they fit a block: sm_80's 163 KB takes one at head
    # dim 256.
    assert V.dbias_tile("sm_90a", 256)[3] == 2 and V.dbias_tile("sm_80", 256)[3] == 1
    # The Hopper kernel (sm90 family up to head dim 128): as many 128 x 64 stages as fit 227 KB, at most 4; the
    # sm90 family takes the SM80-class kernel above.
    assert [V.dbias_tile("sm_90a", hd, "sm90") for hd in (64, 96, 128)] == [
        (128, 64, 384, 4), (128, 64, 384, 3), (128, 64, 384, 2)]
    assert V.sm90_dbias("sm90", 128) and not V.sm90_dbias("sm90", 192) and not V.sm90_dbias("sm80", 64)
    assert V.dbias_tile("sm_90a", 192, "sm90") == V.dbias_tile("sm_90a", 192)


def test_dense_queue_policy():
    """Which sm90 backward kernels queue every layout (`queue_dense`, the registry's queue_all): the measured
    table, bit 0 the dK/dV kernel, bit 1 the dQ kernel; the other families carry 0."""
    def bits(hd, family="sm90"):
        return V.Variant("bwd", "sm_90a", "bf16", hd, False, family).queue_all

    for hd, t in V.TUNING["sm90"].items():
        assert bits(hd) == int(t.dkdv_queue_dense) + 2 * int(t.dq_queue_dense)
    assert (bits(64), bits(96), bits(128), bits(192), bits(256)) == (2, 0, 3, 3, 3)
    assert bits(128, "sm80") == 0 and V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm90").queue_all == 0


def test_cache_key():
    """A unit's cache key changes with its description (variant fields, tuning values) and with the kernel sources,
    and never holds a path, so a build in another folder (pip's temporary environment) reuses its objects."""
    common = cache.common_key()
    v = V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm90")
    assert cache.unit_key(v, common) == cache.unit_key(V.Variant("fwd", "sm_90a", "bf16", 128, False, "sm90"), common)
    others = [V.Variant("fwd", "sm_90a", "bf16", 128, True, "sm90"),
              V.Variant("fwd", "sm_90a", "bf16", 192, False, "sm90"),
              V.Variant("bwd", "sm_90a", "bf16", 128, False, "sm90"),
              V.Variant("fwd", "sm_90a", "bf16", 128, False)]
    assert len({cache.unit_key(u, common) for u in [v] + others}) == 1 + len(others)
    assert cache.unit_key(v, common + "x") != cache.unit_key(v, common)
    assert '"fwd_pin_pv_wait": true' in cache.describe(v)  # tuning values are part of the description
    # The sm80 forward's stages depend on the target arch's shared memory.
    assert V.Variant("fwd", "sm_80", "bf16", 128, False).options["fwd_stages"] == 1
    assert V.Variant("fwd", "sm_90a", "bf16", 128, False).options["fwd_stages"] == 2
    assert "/" not in common.replace("sources=", "") and "kernels" not in cache.describe(v)
