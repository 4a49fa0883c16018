"""Train a small causal LM with pardist, ported from Hugging Face Accelerate's way.

    python examples/porting/lm_accelerate.py      # lm_pardist.py: the port to pardist
    torchrun --standalone --nproc_per_node=2 examples/porting/lm_accelerate.py

Lines of Python's own source are the text (no download), tokenized by a word-level
tokenizer built here and padded per micro-batch into Hugging Face batches. Gradients
accumulate over --grad-accum micro-batches with a token-weighted loss (Accelerate's
"gradient accumulation for autoregressive models" example: every token of the update
counts once), the learning rate warms up and decays linearly, the evaluation loss is
gathered per batch with gather_for_metrics, and the state is saved every
--checkpointing-steps micro-batches and resumed with --resume-from-checkpoint.
docs/porting.md counts the lines the port changes.
"""

import argparse
import contextlib
import inspect
import os

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import set_seed

import pardist


def get_dataloaders(accelerator, args):
    sources = "".join(inspect.getsource(m) for m in (argparse, contextlib, inspect))
    lines = [line.strip() for line in sources.splitlines() if len(line.split()) >= 3]
    lines = lines[: args.max_lines]
    words = sorted({word for line in lines for word in line.split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: i + 2 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]"
    )
    with pardist.rank0_first():  # (datasets' map would cache it here)
        encoded = tokenizer(lines, truncation=True, max_length=args.max_length)["input_ids"]
    split = len(encoded) * 9 // 10

    def collate_fn(examples):  # each micro-batch padded to its own longest line
        batch = tokenizer.pad([{"input_ids": e} for e in examples], return_tensors="pt")
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    train = DataLoader(encoded[:split], args.batch_size, shuffle=False, collate_fn=collate_fn)
    valid = DataLoader(encoded[split:], args.batch_size, shuffle=False, collate_fn=collate_fn)
    return tokenizer, train, valid


def training_function(args):
    pardist.init()
    set_seed(args.seed)
    tokenizer, train_dataloader, eval_dataloader = get_dataloaders(None, args)
    config = tf.GPT2Config(
        vocab_size=len(tokenizer), n_positions=args.max_length, n_embd=args.dim,
        n_layer=args.layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    if args.dtype == "float64":
        model = model.double()
    no_decay = ("bias", "ln_")  # biases and layer norms take no weight decay
    params = list(model.named_parameters())
    groups = [
        {
            "params": [p for n, p in params if not any(k in n for k in no_decay)],
            "weight_decay": 0.01,
        },
        {"params": [p for n, p in params if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    lr_scheduler = tf.get_linear_schedule_with_warmup(
        optimizer, args.warmup, len(train_dataloader) * args.epochs // args.grad_accum
    )
    # Accelerate's sharding: rank r takes every world-th loader batch, a global batch of the
    # world's batches; its prepared scheduler steps once per process at each step().
    lr_scheduler = pardist.optim.prepared(lr_scheduler)
    n = pardist.world_size()
    train_dataloader = pardist.data.shard(
        train_dataloader, split_batches=True, batch_size=args.batch_size * n
    )
    eval_dataloader = pardist.data.shard(
        eval_dataloader, split_batches=True, batch_size=args.batch_size * n
    )
    apply, params, buffers = pardist.functional(model)
    adamw = pardist.optim.from_torch(optimizer, model, lr_scheduler)
    opt = pardist.optim.chain(pardist.optim.clip_by_global_norm(args.max_grad_norm), adamw)
    # The torch optimizer and scheduler go in the checkpoint as they are (their state_dict()):
    # the rates they hold resume with them, as Accelerate's save_state keeps them.
    state = {"params": params, "opt_state": opt.init(params), "optimizer": optimizer}
    state["scheduler"] = lr_scheduler

    def loss_fn(params, batch):  # a micro-batch's sum over its tokens (HF: divided by 1)
        loss = apply(params, buffers, **batch, num_items_in_batch=1)[0].loss
        return loss, (batch["labels"][:, 1:] != -100).sum()

    @pardist.data_parallel(donate_argnums=(0, 1))
    def train_step(params, opt_state, micro_batches):
        vg = pardist.value_and_grad(loss_fn, mean="tokens", accumulate="list")
        loss, grads = vg(params, micro_batches)  # every token of the update counts once
        return *opt.update(grads, opt_state, params), loss

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        pardist.print0(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        state = pardist.checkpoint.load(args.resume_from_checkpoint, state)
        overall_step = int(os.path.basename(args.resume_from_checkpoint).replace("step_", ""))
        starting_epoch = overall_step // len(train_dataloader)
        resume_step = overall_step - starting_epoch * len(train_dataloader)
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        train_dataloader.set_epoch(epoch)  # this epoch's order, in a resumed process too
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = pardist.data.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        updates = pardist.data.micro_batches(active_dataloader, args.grad_accum, drop_last=True)
        for micro_batches in updates:
            params, opt_state, loss = train_step(state["params"], state["opt_state"], micro_batches)
            state.update(params=params, opt_state=opt_state)
            lr_scheduler.step()
            overall_step += args.grad_accum
            loss = loss.item()
            pardist.print0(f"epoch {epoch} step {overall_step}: loss {loss!r}")
            if overall_step % args.checkpointing_steps == 0:
                pardist.checkpoint.save(
                    os.path.join(args.output_dir, f"step_{overall_step}"), state
                )

        model.load_state_dict(pardist.state_dict(state["params"], buffers, model))
        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            rows = len(batch["input_ids"])
            losses.append(eval_dataloader.gather(outputs.loss.detach().repeat(rows)))
        pardist.print0(f"epoch {epoch}: eval loss {torch.cat(losses).mean().item()!r}")
    pardist.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training lines")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="lines per micro-batch and process"
    )
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate")
    parser.add_argument("--warmup", type=int, default=4, help="updates of linear warm-up")
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip the gradients' global norm to this"
    )
    parser.add_argument("--dim", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument(
        "--max-lines", type=int, default=640, help="lines of text to use (90%% train, 10%% eval)"
    )
    parser.add_argument("--max-length", type=int, default=64, help="tokens per line at most")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64"], help="the model's dtype"
    )
    parser.add_argument(
        "--checkpointing-steps",
        type=int,
        default=16,
        help="save the state every this many micro-batches",
    )
    parser.add_argument("--output-dir", default="out-lm", help="where the states go")
    parser.add_argument(
        "--resume-from-checkpoint",
        default=None,
        help="a saved state's folder (step_N) to resume from",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="train on the CPU (Accelerate's multi-CPU mode)"
    )
    parser.add_argument("--seed", type=int, default=42, help="the seed of the model's weights")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
