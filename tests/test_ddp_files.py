"""DDP's checkpoint files both ways: a port reads what the DDP script saved, and writes what
it loads back, with the keys a wrapped model has (``module.``, ``torch.compile``'s
``_orig_mod.``), so that a team can port one script and keep the other."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pardist


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _both_ways(path: str):
    torch.manual_seed(pardist.rank() + 1)  # (each rank builds its own: DDP copies rank 0's)
    wrapped = {
        "ddp": DDP(net()),
        "compiled": torch.compile(net()),  # (nothing compiles until it is called)
        "ddp_of_compiled": DDP(torch.compile(net())),
        "compiled_ddp": torch.compile(DDP(net())),
    }
    out = {}
    for name, model in wrapped.items():
        saved = model.state_dict()
        if pardist.is_main():
            torch.save({"model": saved}, f"{path}/{name}.pt")
        pardist.gather_object(0)  # (the file is written before anyone reads it)
        # The port: a plain module, the DDP script's file, one line changed to read it.
        plain = net()
        ckpt = torch.load(f"{path}/{name}.pt", weights_only=True)
        plain.load_state_dict(pardist.unwrapped(ckpt["model"]))  # strict: every key
        apply, params, buffers = pardist.functional(plain)
        read = all(torch.equal(params[k], v) for k, v in plain.named_parameters())
        # ... and its file, which the DDP script's own load_state_dict reads back.
        prefix = next(iter(saved)).removesuffix("0.weight")
        back = pardist.state_dict(params, buffers, plain, prefix=prefix)
        model.load_state_dict(back)  # strict
        out[name] = (prefix, read, all(torch.equal(back[k], v) for k, v in saved.items()))
    return out


def test_a_port_reads_ddps_files_and_writes_what_ddp_reads(run, tmp_path):
    for out in run(2, _both_ways, str(tmp_path)):
        assert out["ddp"][0] == "module."
        assert out["compiled"][0] == "_orig_mod."
        assert out["ddp_of_compiled"][0] == "module._orig_mod."
        assert out["compiled_ddp"][0] == "_orig_mod.module."
        assert all(read and same for _, read, same in out.values()), out


def test_unwrapped_leaves_other_keys_alone():
    state = {"module.a": 1, "b": 2}
    assert pardist.unwrapped(state) == state
    assert pardist.unwrapped({}) == {}
