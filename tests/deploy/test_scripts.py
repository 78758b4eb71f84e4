"""scripts/test.sh and scripts/setup.sh, run as written on a scratch copy of the repository whose slow parts
(the venv, pip, pytest, the tiers) are stand-ins that log what they were asked to do."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60  # bound on any one wait; nothing here takes more than a second when it works
LINT = "python -m ruff check ."  # the lint step's command line, as the stand-in python logs it


def executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def scratch_repo(tmp_path: Path, script: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    return repo


# ---- scripts/test.sh ------------------------------------------------------------------------------------


@pytest.fixture
def test_sh(tmp_path):
    """test.sh with a set-up that does nothing, a lint that exits $LINT_RC, a main suite that exits $MAIN_RC, and
    tiers `good` (exit 0) and `bad` (exit 3); each step appends its command line to log.txt."""
    repo = scratch_repo(tmp_path, "test.sh")
    log = repo / "log.txt"
    executable(repo / "scripts" / "setup.sh", f'echo "setup $*" >> {log}\n')
    executable(repo / ".venv" / "bin" / "python",
               f'echo "python $*" >> {log}\ncase "$2" in ruff) exit "${{LINT_RC:-0}}";; esac\nexit "${{MAIN_RC:-0}}"\n')
    executable(repo / "scripts" / "tiers" / "good.sh", f'echo "good $*" >> {log}\n')
    executable(repo / "scripts" / "tiers" / "bad.sh", f'echo "bad $*" >> {log}\nexit 3\n')

    def run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        environ = {k: v for k, v in os.environ.items() if k != "TEST_TIERS"} | env
        done = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), *args], env=environ,
                              capture_output=True, text=True, timeout=WAIT_S)
        ran = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return done, ran

    return run


def summary(stdout: str) -> dict[str, tuple[str, int]]:
    """The summary's lines after `scripts/test.sh summary:`: {step: (outcome, seconds)}."""
    lines = stdout.split("scripts/test.sh summary:\n", 1)[1].splitlines()
    parsed = [re.fullmatch(r"  (\S+) +(passed|failed \(exit \d+\)) +(\d+) s", line) for line in lines]
    assert all(parsed), lines
    return {m[1]: (m[2], int(m[3])) for m in parsed}


def test_every_step_runs_after_a_failure_and_the_summary_says_which_failed(test_sh):
    done, ran = test_sh("-k", "some thing", MAIN_RC="1", TEST_TIERS="bad good")
    assert ran == ["setup test", LINT, "python -m pytest -q -ra -k some thing", "bad ", "good "]
    assert done.returncode == 1, done.stderr
    assert {step: outcome for step, (outcome, _) in summary(done.stdout).items()} == {
        "setup": "passed", "lint": "passed", "main": "failed (exit 1)", "bad": "failed (exit 3)", "good": "passed"}
    assert list(summary(done.stdout)) == ["setup", "lint", "main", "bad", "good"]  # in the order they ran


def test_a_lint_error_fails_the_run_and_the_main_suite_still_runs(test_sh):
    done, ran = test_sh(LINT_RC="1", TEST_TIERS="")
    assert ran == ["setup test", LINT, "python -m pytest -q -ra"]
    assert done.returncode == 1, done.stderr
    assert {step: outcome for step, (outcome, _) in summary(done.stdout).items()} == {
        "setup": "passed", "lint": "failed (exit 1)", "main": "passed"}


def test_all_passed_exits_zero(test_sh):
    done, ran = test_sh(TEST_TIERS="good")
    assert done.returncode == 0 and ran == ["setup test", LINT, "python -m pytest -q -ra", "good "]
    assert set(summary(done.stdout)) == {"setup", "lint", "main", "good"}


def test_no_tiers(test_sh):
    done, ran = test_sh(TEST_TIERS="")
    assert done.returncode == 0 and ran == ["setup test", LINT, "python -m pytest -q -ra"]


def test_a_tier_is_its_script(test_sh):
    """A name without scripts/tiers/NAME.sh fails as a step; the default list names only tiers that exist."""
    done, _ = test_sh(TEST_TIERS="good missing")
    assert done.returncode == 1 and summary(done.stdout)["missing"][0].startswith("failed")
    done, _ = test_sh()  # the default list: none of its tiers exist in the scratch copy
    defaults = [step for step in summary(done.stdout) if step not in ("setup", "lint", "main")]
    assert defaults and all((ROOT / "scripts" / "tiers" / f"{tier}.sh").is_file() for tier in defaults)


def test_the_tiers_venvs_are_made_while_the_main_suite_runs(test_sh, tmp_path):
    """A tier that makes a venv (scripts/tiers/venv.sh) is first run with TIER_PREPARE=1 in the background, at
    the start of the main suite (which here waits until it has), then run as a step of its own."""
    log = tmp_path / "repo" / "log.txt"
    made = tmp_path / "repo" / "made"
    executable(tmp_path / "repo" / "scripts" / "tiers" / "venvy.sh",
               f'tier_venv() {{ :; }}\ntier_venv venvy\necho "venvy prepare=${{TIER_PREPARE:-0}}" >> {log}\n'
               f'touch {made}\n')
    main = tmp_path / "repo" / ".venv" / "bin" / "python"
    executable(main, f'echo "python $*" >> {log}\ncase "$2" in pytest) for i in $(seq 100); do '
                     f'[ -e {made} ] && break; sleep 0.1; done;; esac\nexit 0\n')
    done, ran = test_sh(TEST_TIERS="good venvy")
    assert done.returncode == 0, done.stderr
    assert ran[-2:] == ["good ", "venvy prepare=0"] and "venvy prepare=1" in ran[:-2], ran
    assert "good prepare" not in " ".join(ran)  # no venv: nothing to prepare
    assert list(summary(done.stdout)) == ["setup", "lint", "main", "good", "venvy"]


@pytest.mark.parametrize("prepare", ["", "1"])
def test_a_tier_venv_that_is_ready_is_reused(tmp_path, prepare):
    """scripts/tiers/venv.sh's tier_venv under `set -e`, its venv made and stamped already: the tier goes on
    (TIER_FRESH=0), or, when it is only being prepared (TIER_PREPARE=1), ends there with success. (A ready venv
    once ended every tier at once with exit 1: the tier steps failed in 0 s.)"""
    repo = tmp_path / "repo"
    (repo / "scripts" / "tiers").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "tiers" / "venv.sh", repo / "scripts" / "tiers" / "venv.sh")
    (repo / "inputs.txt").write_text("a tier's lock\n")
    executable(repo / ".venv-x" / "bin" / "python", "exit 0\n")
    tier = executable(repo / "scripts" / "tiers" / "x.sh", """
        set -euo pipefail
        cd "$(dirname "$0")/../.."
        source scripts/tiers/venv.sh
        cat scripts/tiers/venv.sh inputs.txt | sha256sum | cut -c1-16 > .venv-x/.tier-stamp
        tier_venv x inputs.txt
        echo "went on, fresh=$TIER_FRESH"
        """)
    done = subprocess.run(["bash", str(tier)], env=os.environ | {"TIER_PREPARE": prepare}, capture_output=True,
                          text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ("" if prepare else "went on, fresh=0\n")


# ---- scripts/setup.sh -----------------------------------------------------------------------------------


@pytest.mark.timeout(WAIT_S)
def test_concurrent_setups_wait_for_each_other(tmp_path):
    """Two set-ups of a fresh clone at once (scripts/serve.sh and scripts/test.sh): the second must wait for
    the first's venv instead of finding its python before pip is in it ("No module named pip").

    The stand-in `python3 -m venv` makes bin/python, says so, and holds until the test lets it put pip in; the
    venv's python fails `-m pip` until then, as a half-made venv does. The second set-up starts while the first
    is held: it must say that it waits for the lock (then both succeed), not run on and fail."""
    repo = scratch_repo(tmp_path, "setup.sh")
    (repo / "pyproject.toml").write_text("[project]\n")
    release, installs = tmp_path / "release", tmp_path / "installs.txt"
    os.mkfifo(release)
    venv_python = executable(tmp_path / "venv_python", f"""\
        if [ "$1 $2" = "-m pip" ]; then
          [ -e "$(dirname "$0")/../pip" ] || {{ echo "$0: No module named pip" >&2; exit 1; }}
          echo "$*" >> {installs}
        fi
        """)  # `-c "import torch"`: succeeds
    fake_python3 = executable(tmp_path / "python3", f"""\
        [ "$1 $2" = "-m venv" ] || exit 2
        mkdir -p "$3/bin" && cp {venv_python} "$3/bin/python"
        echo "venv: python made, pip not yet" >&2
        read -r _ < {release}
        touch "$3/pip"
        """)
    env = os.environ | {"PYTHON": str(fake_python3)}
    setup = ["bash", str(repo / "scripts" / "setup.sh"), "test"]
    start = lambda: subprocess.Popen(setup, env=env, stderr=subprocess.PIPE, text=True,  # noqa: E731
                                     start_new_session=True)
    first = start()
    second = None
    try:
        said = first.stderr.readline()
        assert said == "venv: python made, pip not yet\n", said + first.stderr.read()
        second = start()
        said = second.stderr.readline()  # its first line: that it waits, or how it failed
        assert "waiting for another set-up" in said, said + second.stderr.read()
        with open(release, "w") as fifo:  # the first set-up is reading it: lets it go on
            fifo.write("go\n")
        assert first.wait(WAIT_S) == 0, first.stderr.read()
        assert second.wait(WAIT_S) == 0, second.stderr.read()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # The second found the first's install done (its stamp): nothing changed since, so it installed nothing.
    assert installs.read_text().splitlines() == ["-m pip install -q -e .[test]"]


def test_a_warm_restart_installs_nothing_until_pyproject_or_the_script_changes(tmp_path):
    """scripts/serve.sh runs setup.sh on every start: once the package is installed (editable) it is not
    installed again while pyproject.toml and setup.sh are unchanged; the test extras cover a runtime set-up,
    not the other way round."""
    repo = scratch_repo(tmp_path, "setup.sh")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    installs = tmp_path / "installs.txt"
    executable(repo / ".venv" / "bin" / "python", f'''\
        if [ "$1 $2" = "-m pip" ]; then echo "$*" >> {installs}; fi
        ''')  # `-c "import torch"`: succeeds

    def setup(*args: str) -> list[str]:
        done = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                              timeout=WAIT_S)
        assert done.returncode == 0, done.stderr
        ran = installs.read_text().splitlines() if installs.exists() else []
        installs.unlink(missing_ok=True)
        return ran

    assert setup() == ["-m pip install -q -e ."]  # the first start
    assert setup() == []  # a warm restart
    assert setup("test") == ["-m pip install -q -e .[test]"]  # the test extras were never installed
    assert setup() == setup("test") == []  # they include the runtime's
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['y']\n")
    assert setup() == ["-m pip install -q -e ."]
    with open(repo / "scripts" / "setup.sh", "a") as script:
        script.write("# changed\n")
    assert setup() == ["-m pip install -q -e ."]


# ---- the transformers range ------------------------------------------------------------------------------


def release(version: str) -> tuple[int, ...]:
    """"5.23" -> (5, 23, 0): the release numbers, padded to three."""
    parts = tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))
    return (parts + (0, 0, 0))[:3]


def test_both_ends_of_the_transformers_range_are_tested():
    """pyproject's transformers range is what the tests run against: the main suite at the newest release in it
    (a fresh install resolves that; this run's transformers must be in the range), the torchvision tier at its
    lower end (scripts/tiers/torchvision.sh pins it, and runs the parity tests against transformers there)."""
    import transformers

    low, high = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text()).groups()
    tier = (ROOT / "scripts" / "tiers" / "torchvision.sh").read_text()
    assert release(re.search(r"transformers==([\d.]+)", tier).group(1)) == release(low)
    assert "tests/unit/test_models_parity.py" in tier and "tests/unit/test_preprocessing.py" in tier
    assert release(low) <= release(transformers.__version__) < release(high)


# ---- one torch for GPU machines --------------------------------------------------------------------------


def test_one_torch_for_gpu_machines():
    """The CUDA torch the README and scripts/setup.sh tell a GPU machine to install (TORCH_SPEC) is the one the
    Dockerfile builds with, and its version is the CPU default setup.sh installs."""
    readme = " ".join((ROOT / "README.md").read_text().split())  # the example wraps over two lines
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    def example(before: str, text: str, where: str) -> tuple[str, ...]:
        found = re.search(before + r"torch==([\d.]+) --index-url (https://\S+?)[\"`]", text)
        assert found, f'{where}: no TORCH_SPEC example "torch==<version> --index-url <CUDA index>"'
        return found.groups()

    from_readme = example(r"`TORCH_SPEC` \(e\.g\. `\"", readme, "README.md")
    from_setup = example(r"set TORCH_SPEC \(e\.g\. \"", setup, "scripts/setup.sh")
    from_dockerfile = tuple(re.search(rf"^ARG {arg}=(\S+)$", dockerfile, re.M).group(1)
                            for arg in ("TORCH_VERSION", "TORCH_INDEX_URL"))
    assert from_readme == from_setup == from_dockerfile
    assert re.search(r"\$\{TORCH_SPEC:-torch==([\d.]+)\}", setup).group(1) == from_dockerfile[0]
