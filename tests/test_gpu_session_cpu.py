"""CPU checks of ``scripts/gpu_session.sh`` (the GPU session's stages): it parses, every stage its
header lists has its function, an unknown stage is refused before any work, and every test file and script it runs
exists (a renamed one would cost a GPU call to find out)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_it_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_listed_stage_has_its_function_and_every_function_is_listed():
    """A stage runs as ``stage_<name, - as _>``: a listed stage without one would fail only on
    the GPU, a function the header does not list could not be asked for."""
    text = SCRIPT.read_text()
    header = text.split("# Stages:")[1].split("set -u")[0]
    listed = re.findall(r"^#   ([a-z][a-z0-9-]*)\s", header, re.M)
    functions = re.findall(r"^stage_([a-z0-9_]+)\(\) \{", text, re.M)
    assert listed and len(set(listed)) == len(listed)
    assert sorted(n.replace("-", "_") for n in listed) == sorted(functions)


def test_an_unknown_stage_is_refused_before_any_work(tmp_path):
    # set-up needs the DSL pack: a stand-in env.sh that does nothing, in a copy of the script's tree
    (tmp_path / ".dsl").mkdir()
    (tmp_path / ".dsl" / "env.sh").write_text("")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python3", "nvidia-smi"):  # stand-ins: set-up must not install or query anything here
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "nope"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown stage nope" in r.stdout
    # one unknown among known stages: nothing runs, not even the known ones' set-up
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "gemm", "nope"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown stage nope" in r.stdout and not (tmp_path / "out" / "gpu.txt").exists()


def test_the_files_it_runs_exist():
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:tests|scripts)/[A-Za-z0-9_]+\.py)\b", text))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing
