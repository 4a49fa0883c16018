"""Train an xresnet18 on Imagenette (10 ImageNet classes, real photographs), data parallel.

    python examples/imagenette.py                                       # one process
    torchrun --standalone --nproc_per_node=2 examples/imagenette.py     # two processes

fastai's 160-px archive is fetched once into --cache (or --data names an extracted copy);
DataLoader workers decode JPEGs with Pillow; each global batch is split between the ranks;
validation accuracy is exact; every epoch is checkpointed (--resume). bf16 on GPUs.
"""

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from xresnet import xresnet18  # beside this script

import pardist

URL = "https://s3.amazonaws.com/fast-ai-imageclas/imagenette2-160.tgz"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, on a 0..1 scale


def center_box(w: int, h: int, cw: int, ch: int) -> tuple[int, int, int, int]:
    return (w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch


def random_box(w: int, h: int, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop box, with fastai's minimum scale of 0.35."""
    for _ in range(10):
        area = w * h * random.uniform(*scale)
        aspect = math.exp(random.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = random.randint(0, w - cw), random.randint(0, h - ch)
            return x, y, x + cw, y + ch
    # Ten misses (a very long image): the central crop nearest the allowed aspect ratios.
    return center_box(w, h, min(w, round(h * ratio[1])), min(h, round(w / ratio[0])))


class Images(Dataset):
    """``root/<class>/*.JPEG`` as (uint8 image of size x size, class index)."""

    def __init__(self, root: Path, classes: list[str], size: int, train: bool):
        self.size, self.train = size, train
        files = [sorted((root / name).glob("*.JPEG")) for name in classes]
        self.items = [(path, label) for label, paths in enumerate(files) for path in paths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        with Image.open(path) as img:
            img = img.convert("RGB")  # a few Imagenette JPEGs are greyscale or CMYK
        w, h = img.size
        # Valid: ImageNet's resize of the short side to size / 0.875, then a center crop.
        side = round(min(w, h) * 0.875)
        box = random_box(w, h) if self.train else center_box(w, h, side, side)
        # Crop and resize in one resampling pass; flip half of the training images.
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if self.train and random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # uint8 travels from the workers at a quarter of float32's size; the device normalizes.
        return torch.from_numpy(np.array(img)).permute(2, 0, 1), label


def fail(message: str) -> NoReturn:
    """Exit with a short message (once, from rank 0) instead of every rank's traceback."""
    pardist.print0(
        f"imagenette.py: error: {message}\nGive the data with --data DIR (an extracted copy: "
        "DIR/train/<class>/*.JPEG and DIR/val/<class>/*.JPEG) or --url URL (a .tgz archive, "
        f"downloaded once into --cache; file:// URLs work; default {URL}).",
        file=sys.stderr,
    )
    pardist.shutdown()
    sys.exit(2)


def show(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.{1 if k == 'images_per_s' else 4}f}" for k, v in metrics.items())


def main() -> None:
    workers = min(8, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=defaults)
    parser.add_argument("--data", metavar="DIR", help="an extracted Imagenette: train/, val/")
    parser.add_argument("--url", default=URL, help="the archive to fetch when --data is not given")
    parser.add_argument("--cache", metavar="DIR", default="~/.cache/pardist", help="for --url")
    parser.add_argument("--ckpt", metavar="DIR", default="checkpoints/imagenette", help="saves")
    parser.add_argument("--resume", action="store_true", help="continue from the newest --ckpt")
    parser.add_argument("--epochs", type=int, default=5, help="epochs in the one-cycle schedule")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--bs", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3, help="one-cycle peak learning rate")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
    parser.add_argument("--workers", type=int, default=max(1, workers), help="per process")
    args = parser.parse_args()

    pardist.init()
    device = pardist.device()
    cuda = device.type == "cuda"
    try:  # untar: rank 0 downloads and extracts while the others wait, then they reuse it
        root = Path(args.data) if args.data else pardist.data.untar(args.url, args.cache)
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: rank 0 failed
        fail(str(exc))
    if not all((root / split).is_dir() for split in ("train", "val")):
        fail(f"{root} has no train/ and val/ folders.")
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    train_set = Images(root / "train", classes, args.size, train=True)
    valid_set = Images(root / "val", classes, args.size, train=False)
    if len(train_set) < args.bs or len(valid_set) == 0:
        found = f"{len(train_set)} training and {len(valid_set)} validation images"
        fail(f"{root} holds {found}; --bs {args.bs} needs at least {args.bs} and 1.")
    # Workers from a fork server: a fork of this process (running threads now) can deadlock.
    forked = dict(multiprocessing_context="forkserver", persistent_workers=True)
    options = dict(num_workers=args.workers, pin_memory=cuda, **(forked if args.workers else {}))
    loader = DataLoader(train_set, args.bs, shuffle=True, drop_last=True, **options)
    train = pardist.data.shard(loader, split_batches=True)  # one shuffle; each batch split
    valid = pardist.data.shard(DataLoader(valid_set, args.bs, **options))  # a piece per rank

    pardist.seed_everything(0)  # the same initial parameters on every rank
    model = xresnet18(len(classes), args.width).to(device)
    apply, params, buffers = pardist.functional(model)  # cross-replica (sync) batch norm
    pardist.seed_everything(0, per_rank=True)  # but different augmentation on every rank
    schedule = pardist.optim.one_cycle(args.epochs * len(train), args.lr)
    opt = pardist.optim.adamw(schedule, betas=(0.9, 0.99), eps=1e-5, weight_decay=1e-2)
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) * 255 for v in (MEAN, STD))

    def forward(params, buffers, x, y, training=True):
        x = (x.to(device, non_blocking=True).float() - mean) / std
        with pardist.amp.autocast("bf16", enabled=cuda):  # (on CPU, bf16 convolutions are slower)
            logits, buffers = apply(params, buffers, x, train=training)
        y = y.to(device, non_blocking=True)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1, reduction="none")
        return loss, logits.argmax(1) == y, buffers

    def loss_fn(params, buffers, x, y):
        loss, _, buffers = forward(params, buffers, x, y)
        return loss.mean(), buffers

    @pardist.data_parallel(axis="gpu", donate_argnums=(0, 2))  # donated: updated in place
    def train_step(params, buffers, opt_state, batch):
        grad_fn = pardist.value_and_grad(loss_fn, has_aux=True)
        (loss, buffers), grads = grad_fn(params, buffers, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state, loss

    @torch.no_grad()
    def evaluate(params, buffers) -> tuple[float, float]:
        losses, hits = [], []
        for x, y in pardist.progress(valid, desc="valid", leave=False):
            loss, hit, _ = forward(params, buffers, x, y, training=False)
            losses.append(loss)
            hits.append(hit.float())
        # Every rank's rows in dataset order, without the wrap-around padding: exact.
        losses, hits = pardist.gather((torch.cat(losses), torch.cat(hits)), total=len(valid_set))
        return losses.mean().item(), hits.mean().item()

    names = ("train_loss", "valid_loss", "valid_accuracy", "images_per_s")
    state = dict(epoch=0, metrics=dict.fromkeys(names, math.nan))
    state["model"] = (params, buffers, opt.init(params))
    if args.resume:  # the newest checkpoint that reads back whole; every rank reads the same
        state = pardist.checkpoint.resume(args.ckpt, state, total=args.epochs)
    params, buffers, opt_state = state["model"]
    for epoch in range(state["epoch"], args.epochs):
        train.set_epoch(epoch)
        start, total = time.perf_counter(), torch.zeros((), device=device)
        for batch in pardist.progress(train, desc=f"epoch {epoch + 1}", leave=False):
            params, buffers, opt_state, loss = train_step(params, buffers, opt_state, batch)
            total += loss  # summed on the device: no synchronisation per step
        train_loss = total.item() / len(train)
        # The job runs at its slowest rank's pace; pmax also gives every rank the same value.
        elapsed = torch.tensor(time.perf_counter() - start, device=device)
        seconds = pardist.pmax(elapsed, "gpu").item()
        valid_loss, accuracy = evaluate(params, buffers)
        metrics = dict(
            zip(names, (train_loss, valid_loss, accuracy, len(train) * args.bs / seconds))
        )
        pardist.print0(f"epoch {epoch + 1}/{args.epochs}: {show(metrics)}")
        state = dict(epoch=epoch + 1, metrics=metrics, model=(params, buffers, opt_state))
        pardist.checkpoint.save(args.ckpt, state, step=epoch + 1, keep=2)

    pardist.print0(f"final: epoch={state['epoch']} {show(state['metrics'])}")
    pardist.shutdown()


if __name__ == "__main__":
    main()
