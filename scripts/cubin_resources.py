"""Print the ptxas resource usage (registers, stack, local memory = spills) of the cubins embedded in kernel
objects, e.g. after a build:

    python scripts/cubin_resources.py build/kernels/jps_bwd_sm90k_*_dkdv.o [--cuobjdump PATH]

cuobjdump: --cuobjdump, else PATH, else the pip wheel nvidia-cuda-cuobjdump (scripts/cubins.py).
"""

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cubins import embedded_cubins, find_cuobjdump  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("objects", nargs="+")
    ap.add_argument("--cuobjdump")
    a = ap.parse_args(argv)
    exe = find_cuobjdump(a.cuobjdump)
    with tempfile.TemporaryDirectory() as tmp:
        for path in a.objects:
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
    main()
