"""Print the ptxas resource usage (registers, stack, local memory = spills) of the cubins that
`export_to_c` embedded in kernel objects, e.g. after a build:

    python scripts/cubin_resources.py build/kernels/jps_bwd_sm90k_*_dkdv.o

Needs `cuobjdump` (the pip wheel nvidia-cuda-cuobjdump ships one; found on PATH or next to the
nvidia.cu13 / nvidia.cuda_cuobjdump packages).  The cubin is located by its ELF header (machine EM_CUDA)
inside the object's data and cut at the end of its last section / program header.
"""

import glob
import os
import shutil
import struct
import subprocess
import sys
import tempfile

EM_CUDA = 190


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))
            if hits:
                return hits[0]
    except ImportError:
        pass
    sys.exit("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def embedded_cubins(blob: bytes):
    """Yield every CUDA ELF image inside `blob`, cut to its own length."""
    i = blob.find(b"\x7fELF", 1)
    while i >= 0:
        e = blob[i:]
        if len(e) >= 64 and e[4] == 2 and struct.unpack_from("<H", e, 0x12)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", e, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", e, 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            for k in range(shnum):
                o = shoff + k * shentsize
                sh_type = struct.unpack_from("<I", e, o + 4)[0]
                off, size = struct.unpack_from("<QQ", e, o + 0x18)
                if sh_type != 8:  # SHT_NOBITS occupies no file bytes
                    end = max(end, off + size)
            yield e[:end]
        i = blob.find(b"\x7fELF", i + 4)


def main(paths):
    exe = _cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            with open(path, "rb") as f:
                blob = f.read()
            for n, cubin in enumerate(embedded_cubins(blob)):
                out = os.path.join(tmp, f"{n}.cubin")
                with open(out, "wb") as f:
                    f.write(cubin)
                report = subprocess.run([exe, "--dump-resource-usage", out], capture_output=True, text=True).stdout
                # An export may hold several kernels (e.g. a dense and a compact schedule): each is reported
                # under the tail of its (long, mangled) name.
                name = ""
                for line in report.splitlines():
                    if line.strip().startswith("Function "):
                        name = line.strip()[len("Function "):].rstrip(":")
                    if "REG:" in line:
                        fields = " ".join(line.split()[:4])
                        print(f"{os.path.basename(path)}: {fields}  ...{name[-60:]}")


if __name__ == "__main__":
    main(sys.argv[1:])
