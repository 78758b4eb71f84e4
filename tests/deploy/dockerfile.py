"""./Dockerfile read as instructions: (KEYWORD, arguments) pairs, comments dropped and continuation lines
joined, and the runtime stage's facts the chart and the image tier check against (its USER, EXPOSE, ENV)."""

from __future__ import annotations

import re

from tests.deploy.chart import ROOT


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1] if " " in l.strip() else "")
            for l in text.splitlines() if l.strip()]


def build_args() -> dict[str, str]:
    """ARG defaults (ARGs without one are left out)."""
    return dict(re.match(r"(\w+)=(\S*)", v).groups() for k, v in instructions() if k == "ARG" and "=" in v)


def runtime_stage() -> list[tuple[str, str]]:
    """The instructions of the last stage (the image that ships)."""
    ins = instructions()
    last = [i for i, (k, _) in enumerate(ins) if k == "FROM"][-1]
    return ins[last:]


def runtime_env() -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(v for k, v in runtime_stage() if k == "ENV")))


def runtime_user() -> tuple[int, int]:
    """(uid, gid) of the runtime stage's USER, which must be numeric (runAsNonRoot can only check a number)."""
    (user,) = [v for k, v in runtime_stage() if k == "USER"]
    uid, gid = user.split(":")
    return int(uid), int(gid)


def exposed_ports() -> set[int]:
    return {int(p.split("/")[0]) for k, v in runtime_stage() if k == "EXPOSE" for p in v.split()}
