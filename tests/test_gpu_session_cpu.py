"""CPU checks of ``scripts/gpu_session.sh`` (the GPU session's stages): it parses, every stage its
header lists is dispatched, an unknown stage is refused, and every test file and script it runs
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


def test_every_listed_stage_is_dispatched():
    text = SCRIPT.read_text()
    header = text.split("# Stages:")[1].split("set -u")[0]
    listed = re.findall(r"^#   ([a-z0-9-]+)\s", header, re.M)
    dispatched = re.findall(r"^\s+([a-z0-9-]+)\) stage_", text, re.M)
    assert listed and listed == dispatched


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


def test_the_files_it_runs_exist():
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:tests|scripts)/[A-Za-z0-9_]+\.py)\b", text))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing
