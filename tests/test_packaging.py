"""What a user's ``pip install act-hf`` (a wheel, not this source tree) gets: the CUDA sources the extension
is built from, the few-bit tables and the family patches, found where the installed package looks for them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from act_hf import _ext

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_cuda_sources_and_finds_them(tmp_path):
    # a copy without build outputs: setuptools' build/ folder would hand an old build's files to the wheel
    tree = shutil.copytree(ROOT, tmp_path / "tree", ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".data", ".whl", ".gl", "outputs", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(tree)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("act_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    for source in (*_ext.SOURCES, "dispatch.h"):
        assert f"act_hf/csrc/{source}" in names
    assert {"act_hf/data/fewbit_tables.json", "act_hf/patches/__init__.py", "act_hf/patches/bert.py"} <= names

    # the installed copy, not this tree: the extension builds from the wheel's sources, the tables load
    probe = ("import act_hf, act_hf._ext as e, act_hf.fewbit as f; "
             "print(act_hf.__file__); print(e.CSRC_DIR); print(f.get_table('gelu', 2).bits)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                         check=True, capture_output=True, text=True).stdout.split("\n")
    site = (tmp_path / "site" / "act_hf").resolve()
    assert Path(out[0]).resolve().parent == site
    assert Path(out[1]).resolve() == site / "csrc"
    assert out[2] == "2"
