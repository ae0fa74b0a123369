"""Compare the device code of two kernel build folders (`python -m jax_padsafe.kernels.build --out DIR`).

    python scripts/compare_kernels.py OLD_DIR NEW_DIR [--cuobjdump PATH] [--jobs N] [--context N]

For every `<export>.o` present in both folders the embedded cubins are extracted (scripts/cubins.py) and compared:
- "identical bytes": the cubins are byte-identical;
- "identical SASS": `cuobjdump -sass` of both is the same once the kernel function names are normalised (the DSL
  names a kernel after the Python module path and class it was traced from, so moving a kernel class between
  modules renames it without changing its code);
- "DIFFERS": anything else, shown with the first differing lines.
Objects present in only one folder are listed. Exit status 1 when any export differs, else 0.
"""

import argparse
import concurrent.futures as cf
import difflib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cubins import embedded_cubins, find_cuobjdump  # noqa: E402

# kernel_cutlass_kernel_<module path><class>_object_at_<argument signature, truncated>_<index>
_KERNEL_NAME = re.compile(r"\bkernel_cutlass_kernel_\w*?_(\d+)\b")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")


def _normalise(name: str) -> str:
    return _KERNEL_NAME.sub(r"kernel_cutlass_kernel_<name>_\1", name)


def sass(cuobjdump: str, cubin: bytes, tmp: str, tag: str) -> dict:
    """{normalised function name: its SASS lines (names normalised, the encoding comments kept)}."""
    path = os.path.join(tmp, tag + ".cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    text = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    os.remove(path)
    functions, name = {}, ""
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = _normalise(m.group(1))
            functions[name] = []
        functions.setdefault(name, []).append(_normalise(line.rstrip()))
    return functions


def compare(export: str, old_dir: str, new_dir: str, cuobjdump: str, context: int):
    """(verdict, detail lines) for one export."""
    cubins = []
    for d in (old_dir, new_dir):
        with open(os.path.join(d, export + ".o"), "rb") as f:
            cubins.append(embedded_cubins(f.read()))
    old, new = cubins
    if not old or not new:
        return "DIFFERS", [f"  no embedded cubin in {'the old' if not old else 'the new'} object"]
    if old == new:
        return "identical bytes", []
    if len(old) != len(new):
        return "DIFFERS", [f"  {len(old)} cubins against {len(new)}"]
    with tempfile.TemporaryDirectory() as tmp:
        for k, (a, b) in enumerate(zip(old, new)):
            sa, sb = sass(cuobjdump, a, tmp, f"old{k}"), sass(cuobjdump, b, tmp, f"new{k}")
            if sa == sb:
                continue
            if sorted(sa) != sorted(sb):
                return "DIFFERS", [f"  functions: {sorted(sa)} against {sorted(sb)}"]
            for name in sorted(sa):
                if sa[name] != sb[name]:
                    diff = list(difflib.unified_diff(sa[name], sb[name], "old", "new", n=1, lineterm=""))
                    return "DIFFERS", [f"  cubin {k}, {name}:"] + ["    " + ln for ln in diff[2:2 + context]]
    return "identical SASS", []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old_dir")
    ap.add_argument("new_dir")
    ap.add_argument("--cuobjdump", help="path of cuobjdump (default: PATH, then the nvidia-cuda-cuobjdump wheel)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--context", type=int, default=12, help="differing lines shown per export")
    a = ap.parse_args(argv)
    cuobjdump = find_cuobjdump(a.cuobjdump)
    exports = [{f[:-2] for f in os.listdir(d) if f.endswith(".o")} for d in (a.old_dir, a.new_dir)]
    both = sorted(exports[0] & exports[1])
    counts = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        results = ex.map(lambda e: compare(e, a.old_dir, a.new_dir, cuobjdump, a.context), both)
        for export, (verdict, detail) in zip(both, results):
            counts[verdict] = counts.get(verdict, 0) + 1
            print(f"{verdict:16s} {export}")
            for line in detail:
                print(line)
    for label, only in (("only in old", exports[0] - exports[1]), ("only in new", exports[1] - exports[0])):
        for export in sorted(only):
            print(f"{label:16s} {export}")
    summary = ", ".join(f"{v}: {counts.get(v, 0)}" for v in ("identical bytes", "identical SASS", "DIFFERS"))
    print(f"{len(both)} exports in both folders ({summary}); only in old: {len(exports[0] - exports[1])}, "
          f"only in new: {len(exports[1] - exports[0])}")
    return 1 if counts.get("DIFFERS") else 0


if __name__ == "__main__":
    sys.exit(main())
