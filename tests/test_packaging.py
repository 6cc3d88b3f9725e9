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
    # every file of csrc/ is a source or a header whose text keys the build, so no edit of it keeps an old build
    assert sorted((*_ext.SOURCES, *_ext.HEADERS)) == sorted(p.name for p in (ROOT / "csrc").iterdir() if p.is_file())
    for source in (*_ext.SOURCES, *_ext.HEADERS):
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


def test_a_source_tree_on_the_path_finds_the_families(tmp_path):
    """A checkout run with ``PYTHONPATH=.`` and no install (the GPU machine has no pip): ``act_hf.patches`` is
    the ``patches/`` folder beside the package, and a model patches and trains."""
    probe = f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path.insert(0, {str(ROOT)!r})
import torch
import act_hf
from transformers import BertConfig, BertForSequenceClassification

model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=64)).train()
act_hf.patch(model, bits=3)
import act_hf.patches
with act_hf.track_saved(model) as saved:
    model(input_ids=torch.randint(0, 50, (2, 8)), labels=torch.zeros(2, dtype=torch.long)).loss.backward()
print(act_hf.patches.__file__)
print(act_hf.patcher.__file__)
print(model.act_hf_family, any(slot.endswith(":q") for slot in saved.by_slot))
"""
    out = subprocess.run([sys.executable, "-c", probe], check=False, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert Path(lines[0]) == ROOT / "patches" / "__init__.py"
    assert Path(lines[1]) == ROOT / "act_hf" / "patcher.py"
    assert lines[2] == "bert True"
