"""Dependency closure of the wheels in .whl/ against the GPU image's package list (the device tool's KINDS.md,
a markdown page that lists the image's packages).

    python3 scripts/gpu/check_wheels.py --kinds PATH/KINDS.md [--wheels .whl]

For each wheel: its non-extra Requires-Dist for CPython 3.12 on x86_64 Linux, and where each need is met:
another carried wheel (its version checked against the specifier) or the image's list (names only: the
image's versions are not known here, so a versioned need met only by the image is flagged "check").
Also flags two versions of one name and packages the project needs that neither provides. Exits 1 on a gap.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
ENV = default_environment() | dict(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
                                   platform_python_implementation="CPython", sys_platform="linux",
                                   platform_system="Linux", platform_machine="x86_64", os_name="posix")


def image_packages(kinds: Path) -> set[str]:
    text = kinds.read_text()
    section = text[text.index("## Python packages already there"):]
    listed = section.split("Packages:", 1)[1].split("\n\n", 1)[0]
    return {canonicalize_name(n.strip().rstrip(".")) for n in listed.split(",") if n.strip()}


def wheel_meta(path: Path) -> tuple[str, Version, list[Requirement]]:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(zf.read(name).decode())
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(ENV | {"extra": ""}):
            continue  # an extra's need, or another Python / platform
        reqs.append(req)
    return canonicalize_name(meta["Name"]), Version(meta["Version"]), reqs


def project_needs() -> list[Requirement]:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(d.split("#")[0].strip()) for d in deps]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", required=True, help="the page that lists the GPU image's packages")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"))
    args = parser.parse_args()
    image = image_packages(Path(args.kinds))
    wheels: dict[str, tuple[Version, list[Requirement], Path]] = {}
    problems = []
    for path in sorted(Path(args.wheels).glob("*.whl")):
        name, version, reqs = wheel_meta(path)
        if name in wheels:
            problems.append(f"two versions of {name}: {wheels[name][0]} and {version}")
        wheels[name] = (version, reqs, path)
    total = 0
    print(f"{'wheel':60s} {'MiB':>6s}  needs (-> where met)")
    for name, (version, reqs, path) in sorted(wheels.items()):
        size = path.stat().st_size
        total += size
        met = []
        for req in reqs:
            dep = canonicalize_name(req.name)
            if dep in wheels:
                ok = req.specifier.contains(wheels[dep][0], prereleases=True)
                met.append(f"{req} -> wheel {wheels[dep][0]}" + ("" if ok else " CONFLICT"))
                if not ok:
                    problems.append(f"{name} needs {req}, carried {dep} is {wheels[dep][0]}")
            elif dep in image:
                met.append(f"{req} -> image" + (" (version not known here: check)" if str(req.specifier) else ""))
            else:
                met.append(f"{req} -> MISSING")
                problems.append(f"{name} needs {req}: neither carried nor in the image")
        print(f"{path.name:60s} {size / 2**20:6.2f}  " + ("; ".join(met) or "-"))
    print(f"total {len(wheels)} wheels, {total / 2**20:.1f} MiB")
    print("\nproject dependencies (pyproject.toml):")
    for req in project_needs():
        dep = canonicalize_name(req.name)
        if dep in wheels:
            ok = req.specifier.contains(wheels[dep][0], prereleases=True)
            print(f"  {str(req):32s} wheel {wheels[dep][0]}" + ("" if ok else "  CONFLICT"))
            if not ok:
                problems.append(f"project needs {req}, carried {wheels[dep][0]}")
        elif dep in image:
            print(f"  {str(req):32s} image")
        else:
            print(f"  {str(req):32s} MISSING")
            problems.append(f"project needs {req}: neither carried nor in the image")
    print("\n" + ("closure complete" if not problems else "PROBLEMS:\n  " + "\n  ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
