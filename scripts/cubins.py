"""The device code inside the kernel objects the build exports, for the scripts next to this file.

`export_to_c` writes `<export>.o`, an x86-64 object whose `.lrodata` section holds the cubin: an ELF image with
e_machine EM_CUDA (190). `cuobjdump` (CUDA toolkit, or the pip wheel nvidia-cuda-cuobjdump) disassembles it.
"""

import glob
import os
import shutil
import struct

EM_CUDA = 190
SHT_NOBITS = 8


def find_cuobjdump(explicit=None) -> str:
    """`explicit`, else cuobjdump on PATH, else the one in an installed nvidia-* wheel."""
    if explicit:
        return explicit
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))
            if hits:
                return hits[0]
    except ImportError:
        pass
    raise SystemExit("cuobjdump not found: pass --cuobjdump, put it on PATH or pip install nvidia-cuda-cuobjdump")


def _sections(obj: bytes):
    """(name, type, offset, size) of every section of a 64-bit little-endian ELF."""
    shoff = struct.unpack_from("<Q", obj, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", obj, 0x3A)
    raw = [struct.unpack_from("<IIQQQQ", obj, shoff + k * shentsize) for k in range(shnum)]
    strtab = raw[shstrndx][4]
    out = []
    for name, typ, _flags, _addr, off, size in raw:
        start = strtab + name
        out.append((obj[start:obj.index(b"\0", start)].decode(), typ, off, size))
    return out


def _own_length(image: bytes) -> int:
    """Length of a CUDA ELF image from its own headers (the end of its last section or header table)."""
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for k in range(shnum):
        o = shoff + k * shentsize
        typ = struct.unpack_from("<I", image, o + 4)[0]
        off, size = struct.unpack_from("<QQ", image, o + 0x18)
        if typ != SHT_NOBITS:
            end = max(end, off + size)
    return end


def embedded_cubins(obj: bytes):
    """Every cubin inside the kernel object `obj`: each EM_CUDA ELF image found in its `.lrodata` section (any
    section, for an object without one), sliced to the end of that section and then to the image's own length."""
    secs = [s for s in _sections(obj) if s[1] != SHT_NOBITS]
    lrodata = [s for s in secs if s[0] == ".lrodata"]
    out = []
    for _name, _typ, off, size in lrodata or secs:
        data = obj[off:off + size]
        i = data.find(b"\x7fELF")
        while i >= 0:
            image = data[i:]
            if len(image) >= 64 and image[4] == 2 and struct.unpack_from("<H", image, 0x12)[0] == EM_CUDA:
                out.append(image[:min(len(image), _own_length(image))])
            i = data.find(b"\x7fELF", i + 4)
        if out:
            break
    return out
