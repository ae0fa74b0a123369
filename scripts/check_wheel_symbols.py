"""Checks the shared libraries inside a wheel against a manylinux policy by their ELF dynamic sections:
the symbol versions they need (GLIBC_*, GLIBCXX_*, CXXABI_*, GCC_*) are no newer than the policy's
glibc and libstdc++ allow, the libraries they need are ones the policy lets a wheel need, and they
export only the ``jps_*`` entry points (ffi/jps.version).

    python scripts/check_wheel_symbols.py dist/jax_padsafe-*.whl [--policy manylinux_2_28]

Independent of auditwheel's verdict, and readable: it prints every library's NEEDED list and its
highest version of each kind. This is a check of what the dynamic loader will be asked for, not a
load test on an old system. Needs pyelftools (a dependency of auditwheel). Exit status 1 on any
violation.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import zipfile

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

# The newest symbol versions and the libraries a manylinux_2_28 x86_64 wheel may need (PEP 600 and
# auditwheel's policy table for manylinux_2_28: glibc 2.28, GCC 8's libstdc++ 3.4.25 / CXXABI 1.3.11).
POLICIES = {
    "manylinux_2_28": {
        "versions": {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 25), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)},
        "libs": {"libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libc.so.6",
                 "libnsl.so.1", "libutil.so.1", "libpthread.so.0", "libresolv.so.2", "libX11.so.6",
                 "libXext.so.6", "libXrender.so.1", "libICE.so.6", "libSM.so.6", "libGL.so.1",
                 "libgobject-2.0.so.0", "libgthread-2.0.so.0", "libglib-2.0.so.0", "ld-linux-x86-64.so.2"},
    },
}
_VERSION = re.compile(r"^(GLIBC|GLIBCXX|CXXABI|GCC)_(\d+(?:\.\d+)*)$")


def analyse(data: bytes):
  """``(needed libraries, {kind: [versions]}, defined global function and object symbols)`` of one ELF file."""
  elf = ELFFile(io.BytesIO(data))
  needed, versions, exports = [], {}, set()
  for section in elf.iter_sections():
    if isinstance(section, DynamicSection):
      needed += [t.needed for t in section.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    elif isinstance(section, GNUVerNeedSection):
      for _, auxiliaries in section.iter_versions():
        for aux in auxiliaries:
          m = _VERSION.match(aux.name)
          if m:
            versions.setdefault(m.group(1), set()).add(tuple(int(x) for x in m.group(2).split(".")))
          else:  # e.g. GLIBC_PRIVATE: no policy allows it
            versions.setdefault("other", set()).add(aux.name)
  dynsym = elf.get_section_by_name(".dynsym")
  for sym in dynsym.iter_symbols() if dynsym is not None else ():
    if (sym["st_shndx"] != "SHN_UNDEF" and sym["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")
        and sym["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT")):
      exports.add(sym.name)
  return needed, {k: sorted(v) for k, v in versions.items()}, exports


def check_wheel(path: str, policy_name: str) -> list[str]:
  policy = POLICIES[policy_name]
  problems, libraries = [], 0
  with zipfile.ZipFile(path) as wheel:
    for name in wheel.namelist():
      if not re.search(r"\.so(\.\d+)*$", name):
        continue
      libraries += 1
      needed, versions, exports = analyse(wheel.read(name))
      print(f"{name}\n  NEEDED: {', '.join(needed)}")
      for other in versions.pop("other", []):
        problems.append(f"{name} needs the symbol version {other}, which no manylinux policy allows")
      for kind, found in sorted(versions.items()):
        newest, limit = found[-1], policy["versions"][kind]
        dotted = lambda v: ".".join(map(str, v))  # noqa: E731
        print(f"  {kind}: newest {kind}_{dotted(newest)} (limit {kind}_{dotted(limit)}; {len(found)} versions)")
        problems += [f"{name} needs {kind}_{dotted(v)}, newer than {policy_name} allows ({kind}_{dotted(limit)})"
                     for v in found if v > limit]
      problems += [f"{name} needs {lib}, which {policy_name} does not let a wheel need"
                   for lib in needed if lib not in policy["libs"]]
      foreign = sorted(e for e in exports if not e.startswith("jps_"))
      print(f"  exports: {len(exports)} symbols, {len(exports) - len(foreign)} of them jps_*")
      problems += [f"{name} exports {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''} "
                   f"({len(foreign)} symbols besides jps_*)"] if foreign else []
  if libraries == 0:
    problems.append(f"{path} holds no shared library")
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("wheels", nargs="+")
  parser.add_argument("--policy", default="manylinux_2_28", choices=sorted(POLICIES))
  args = parser.parse_args(argv)
  problems = [p for w in args.wheels for p in check_wheel(w, args.policy)]
  for p in problems:
    print(f"FAIL: {p}")
  if not problems:
    print(f"symbol versions and needed libraries within {args.policy}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
