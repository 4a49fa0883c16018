"""End to end: examples/imagenette.py under torchrun on a small Imagenette-shaped archive.

The archive is made of real photographs (crops of scikit-learn's two sample
JPEGs, one class per region), laid out as ``imagenette2-160/{train,val}/<class>/
*.JPEG`` and served over a ``file://`` URL, so the example's whole path runs:
download, atomic extraction into the cache, Pillow decoding in DataLoader
workers, sharded training on two ranks, exact gathered validation, checkpoints,
``--resume``, and the error without data. Every subprocess is bounded.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "imagenette.py"
FINAL = re.compile(
    r"^final: epoch=(\d+) train_loss=(\S+) valid_loss=(\S+) valid_accuracy=(\S+) "
    r"images_per_s=(\S+)$"
)
# Classes: the left and right halves of each photograph (china.jpg, flower.jpg: 640 x 427).
REGIONS = {"n0china_left": (0, 0.0), "n1china_right": (0, 0.5)}
REGIONS |= {"n2flower_left": (1, 0.0), "n3flower_right": (1, 0.5)}
SMALL = ["--size", "32", "--bs", "8", "--width", "8", "--workers", "1", "--lr", "1e-2"]
TIMEOUT = 280  # an example run, generous for a loaded machine (a quiet one: about 15 s)


def make_archive(folder: Path, train: int = 8, valid: int = 4) -> Path:
    """``folder/imagenette2-160.tgz``: jittered crops of real photos, 160 px on the short side."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(0)
    top = folder / "imagenette2-160"
    for split, count in (("train", train), ("val", valid)):
        for name, (photo, left) in REGIONS.items():
            w, h = photos[photo].size
            (top / split / name).mkdir(parents=True)
            for i in range(
                count
            ):  # a jittered square within the half, stored 213 x 160 as Imagenette-160 is
                side = int(rng.uniform(0.3, 0.45) * w)
                x, y = int(left * w + rng.uniform(0, w / 2 - side)), int(rng.uniform(0, h - side))
                crop = photos[photo].crop((x, y, x + side, y + side)).resize((213, 160))
                crop.save(top / split / name / f"{name}_{i}.JPEG", quality=90)
    archive = folder / "imagenette2-160.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return archive


def example(*args: str, nproc: int = 2, cwd: Path) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARDIST_TIMEOUT": "60"}
    return subprocess.run(
        [*launcher, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def final_line(out: subprocess.CompletedProcess) -> tuple[int, float, float, float, float]:
    assert out.returncode == 0, out.stdout + out.stderr
    finals = [line for line in out.stdout.splitlines() if line.startswith("final:")]
    assert len(finals) == 1, out.stdout
    assert out.stdout.rstrip().splitlines()[-1] == finals[0]
    match = FINAL.match(finals[0])
    assert match, finals[0]
    epoch, *values = match.groups()
    return (int(epoch), *map(float, values))


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    return make_archive(tmp_path_factory.mktemp("imagenette"))


@pytest.mark.timeout(2 * TIMEOUT + 40)  # two runs
def test_torchrun_downloads_once_trains_and_resumes(archive: Path, tmp_path: Path):
    cache, ckpt = tmp_path / "cache", tmp_path / "ckpt"
    common = ["--url", archive.as_uri(), "--cache", str(cache), "--ckpt", str(ckpt), *SMALL]
    first = example("--epochs", "1", *common, cwd=tmp_path)
    epoch, train_loss, valid_loss, accuracy, speed = final_line(first)
    assert epoch == 1
    assert math.isfinite(train_loss) and math.isfinite(valid_loss)
    assert 0.0 <= accuracy <= 1.0 and speed > 0
    assert first.stdout.count("epoch 1/1:") == 1  # per-epoch metrics, printed by rank 0 only
    extracted = cache / "imagenette2-160"
    assert sorted(p.name for p in extracted.iterdir()) == ["train", "val"]
    assert [p.name for p in cache.iterdir()] == ["imagenette2-160"]  # nothing partial left
    stamp = extracted.stat().st_ino  # a new extraction would be a new folder
    assert (ckpt / "1").is_dir()

    # The archive is gone: the second run must reuse the cache; it resumes after epoch 1.
    moved = archive.rename(archive.with_suffix(".moved"))
    try:
        second = example("--epochs", "2", "--resume", *common, cwd=tmp_path)
    finally:
        moved.rename(archive)
    epoch, train_loss, valid_loss, accuracy, _ = final_line(second)
    assert epoch == 2 and math.isfinite(train_loss) and 0.0 <= accuracy <= 1.0
    assert "resumed from" in second.stdout and "epoch 2/2:" in second.stdout
    assert "epoch 1/2:" not in second.stdout  # epoch 1 came from the checkpoint
    assert extracted.stat().st_ino == stamp
    assert (ckpt / "2").is_dir()


def test_python_runs_on_an_extracted_copy(archive: Path, tmp_path: Path):
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    data = tmp_path / "imagenette2-160"
    args = ["--data", str(data), "--epochs", "1", "--ckpt", str(tmp_path / "ckpt"), *SMALL]
    out = example(*args, nproc=1, cwd=tmp_path)
    epoch, train_loss, valid_loss, accuracy, speed = final_line(out)
    assert epoch == 1 and math.isfinite(train_loss) and math.isfinite(valid_loss)
    assert 0.0 <= accuracy <= 1.0 and speed > 0


@pytest.mark.parametrize("nproc", [1, 2])
def test_without_network_or_data_a_clear_error(tmp_path: Path, nproc: int):
    # Port 9 (discard) on the loopback: refused at once, as a machine without network is.
    args = ["--url", "http://127.0.0.1:9/imagenette2-160.tgz", "--cache", str(tmp_path)]
    out = example(*args, *SMALL, nproc=nproc, cwd=tmp_path)
    assert out.returncode != 0
    assert "--data" in out.stderr and "--url" in out.stderr, out.stderr
    assert "could not download" in out.stderr
    assert "imagenette.py: error" in out.stderr
    # No traceback from the example itself (torchrun adds its own failure report).
    assert 'imagenette.py", line' not in out.stderr, out.stderr
    if nproc == 1:
        assert "Traceback" not in out.stderr, out.stderr
    assert list(tmp_path.glob(".*partial")) == []


def test_missing_data_folder_a_clear_error(tmp_path: Path):
    out = example("--data", str(tmp_path / "nowhere"), *SMALL, nproc=1, cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "nowhere has no train/ and val/" in out.stderr
    assert "--data" in out.stderr and "--url" in out.stderr
