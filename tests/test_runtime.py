"""init / shutdown / who-am-I, and meshes."""

from __future__ import annotations

import pytest
import torch

import pardist


def test_plain_python_process_is_world_size_one():
    assert not pardist.is_initialized() and pardist.world_size() == 1
    mesh = pardist.init()
    try:
        assert pardist.init() is mesh  # idempotent
        assert mesh.shape == {"gpu": 1} and mesh.axis_names == ("gpu",)
        assert (pardist.rank(), pardist.world_size(), pardist.local_rank()) == (0, 1, 0)
        assert pardist.is_main() and pardist.device() == torch.device("cpu")
        assert pardist.psum(torch.ones(2), "gpu").tolist() == [1.0, 1.0]
    finally:
        pardist.shutdown()
    assert not pardist.is_initialized()
    with pardist.distributed() as mesh:
        assert pardist.is_initialized() and mesh.size("gpu") == 1
    assert not pardist.is_initialized()


def _who():
    return (
        pardist.rank(),
        pardist.world_size(),
        pardist.local_rank(),
        pardist.is_main(),
        pardist.init().shape,
        str(pardist.device()),
    )


def test_ranks_under_a_launcher(run):
    assert run(3, _who) == [(r, 3, r, r == 0, {"gpu": 3}, "cpu") for r in range(3)]


def _meshes():
    mesh = pardist.Mesh({"node": 2, "gpu": -1})
    out = [
        mesh.shape,
        mesh.index("node"),
        mesh.index("gpu"),
        mesh.index(("node", "gpu")),
        mesh.size(("node", "gpu")),
    ]
    with mesh:  # collectives default to the innermost `with mesh:`
        out.append(pardist.psum(torch.ones(1), "node").item())
    errors = []
    for bad in (
        {"node": 3, "gpu": -1},
        {"node": -1, "gpu": -1},
        {"node": 3, "gpu": 1},
        {"node": 0},
        {1: 4},
    ):
        try:
            pardist.Mesh(bad)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return out, errors


def test_meshes(run):
    got = run(4, _meshes)
    for r, (out, errors) in enumerate(got):
        assert out == [{"node": 2, "gpu": 2}, r // 2, r % 2, r, 4, 2.0]
        assert "the sizes {'node': 3, 'gpu': -1} cannot fill the world size 4" in errors[0]
        assert "only one axis may be -1" in errors[1]
        assert (
            "axis sizes {'node': 3, 'gpu': 1} multiply to 3, but the world size is 4. "
            "Give sizes whose product is 4"
        ) in errors[2]
        assert "axis 'node' has size 0" in errors[3]
        assert "axis names must be strings" in errors[4]


def test_mesh_needs_init():
    with pytest.raises(RuntimeError, match=r"pardist.Mesh: the process group is not started"):
        pardist.Mesh({"gpu": 1})


@pytest.mark.timeout(300)
def test_shutdown_lets_the_process_group_go():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "shutdown.py"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank}: gloo threads after shutdown: 0" in out.stdout, out.stdout
