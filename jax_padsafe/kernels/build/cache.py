"""Hash-keyed reuse of exported kernel objects.

A compile unit (a variant's exports, `<export>.o` + `<export>.h`) is reused when its key is unchanged. The key
hashes what the objects are compiled from:
- the kernel sources: every .py file under jax_padsafe/kernels/ (by path relative to that folder, and contents),
  except the parts of this package that do not reach a compiled object (`IGNORED`);
- the versions of the installed nvidia-cutlass-dsl distributions (the compiler);
- the unit's full description: its fields (kind, family, arch = the target, dtype, head dim, softcap) and every
  tuning value it is compiled with (`Variant.options`).
No absolute path enters the key, so a build in another folder or a temporary environment (pip) reuses objects.
After a successful compile `<prefix>.stamp` (JSON: key, the facts the registry takes from the compiled
kernels) is written last; a missing or different stamp, or a missing export, means a recompile.
"""

import hashlib
import importlib.metadata
import json
import os

KERNELS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files of this package that do not change a compiled object (the variant description covers variants.py).
IGNORED = {"build/__main__.py", "build/cache.py", "build/registry.py", "build/variants.py"}


def sources_digest() -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(KERNELS_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, KERNELS_DIR).replace(os.sep, "/")
            if rel in IGNORED:
                continue
            with open(path, "rb") as f:
                data = f.read()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def dsl_versions() -> str:
    versions = {}
    for d in importlib.metadata.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-cutlass-dsl"):
            versions[name] = d.version
    return ",".join(f"{n}=={versions[n]}" for n in sorted(versions))


def describe(unit) -> str:
    """The unit's full description: its fields and its tuning values, as canonical JSON."""
    fields = {k: getattr(unit, k) for k in unit.__dataclass_fields__}
    return json.dumps({"type": type(unit).__name__, "fields": fields, "options": unit.options,
                       "exports": list(unit.exports)}, sort_keys=True, default=list)


def unit_key(unit, common: str) -> str:
    """`common`: `common_key()`, computed once per build."""
    return hashlib.sha256(f"{common}\n{describe(unit)}".encode()).hexdigest()


def common_key() -> str:
    return f"sources={sources_digest()}\ndsl={dsl_versions()}"


def _stamp_path(out: str, unit) -> str:
    return os.path.join(out, unit.prefix + ".stamp")


def lookup(out: str, unit, key: str):
    """The facts stored with `unit`'s objects in `out` if they were compiled under `key`, else None."""
    try:
        with open(_stamp_path(out, unit)) as f:
            stamp = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    if stamp.get("key") != key:
        return None
    if not all(os.path.isfile(os.path.join(out, e + ext)) for e in unit.exports for ext in (".o", ".h")):
        return None
    return stamp.get("facts", {})


def invalidate(out: str, unit):
    """Called before `unit` is compiled: an interrupted compile leaves no stamp behind."""
    try:
        os.remove(_stamp_path(out, unit))
    except FileNotFoundError:
        pass


def store(out: str, unit, key: str, facts: dict):
    path = _stamp_path(out, unit)
    with open(path + ".tmp", "w") as f:
        json.dump({"key": key, "facts": facts}, f, sort_keys=True)
    os.replace(path + ".tmp", path)
