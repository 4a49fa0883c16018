"""Hugging Face batches as they come: every collator returns a ``BatchEncoding``, every
model a ``ModelOutput``, and pardist takes both wherever it walks trees.

Transformers' own collators (``DataCollatorWithPadding``, ``DataCollatorForLanguageModeling``)
batch lines of text through ``pardist.data.shard``; a data-parallel step takes the
``BatchEncoding`` whole, its loss returns the model's ``ModelOutput`` as aux, and at 2
ranks the gradients equal plain torch's on the whole batch in one process (float64, the
token-weighted loss computed from the logits: ``numerics``). ``gather``, checkpoints and
the step's outputs give back the types that went in; keys that differ between ranks are
an error naming the key.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers as tf  # noqa: E402
from numerics import assert_close64  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import pardist  # noqa: E402

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a b c",
    "pardist takes hugging face batches as they are",
    "every collator returns a batch encoding",
    "one two three four five six",
    "x y",
    "padded to the longest line of each batch",
    "the end",
]


def tokenizer() -> tf.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for line in LINES for w in line.split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config).double()


def token_sum(logits, labels):
    """The next-token loss summed over the labelled tokens (float64, from the logits)."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def _on_ranks():
    tok = tokenizer()
    collate = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    features = [tok(line) for line in LINES]
    loader = pardist.data.shard(DataLoader(features, batch_size=4, collate_fn=collate))
    net = model(len(tok))
    apply, params, _ = pardist.functional(net)

    def loss_fn(p, batch):
        out = apply(p, {}, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
        return (token_sum(out.logits, batch["labels"]), batch["labels"][:, 1:].ne(-100).sum()), out

    @pardist.data_parallel(out_specs=(pardist.P(), pardist.P(), pardist.P("gpu")))
    def step(params, batch):
        vg = pardist.value_and_grad(loss_fn, has_aux=True, mean="tokens")
        (loss, out), grads = vg(params, batch)
        return loss, grads, batch  # the batch back: a per-rank output

    batch = next(iter(loader))
    assert type(batch).__name__ == "BatchEncoding"
    loss, grads, back = step(params, batch)
    lengths = pardist.gather(tf.BatchEncoding({"tokens": back["attention_mask"].sum(1)}))
    return float(loss), grads, type(back).__name__, type(lengths).__name__, lengths["tokens"]


def test_a_collators_batch_trains_as_one_process(run):
    tok = tokenizer()
    whole = tf.DataCollatorForLanguageModeling(tok, mlm=False)([tok(line) for line in LINES[:8]])
    net = model(len(tok))
    logits = net(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits
    count = whole["labels"][:, 1:].ne(-100).sum()
    loss = token_sum(logits, whole["labels"]) / count
    loss.backward()
    want = {k: p.grad for k, p in net.named_parameters()}
    for value, grads, kind, gathered_kind, lengths in run(2, _on_ranks):
        assert kind == gathered_kind == "BatchEncoding"
        assert lengths.tolist() == [len(line.split()) for line in LINES]  # each rank's 4 rows
        assert_close64({"loss": torch.tensor(value, dtype=torch.float64), **grads},
                       {"loss": loss.detach(), **want})  # fmt: skip


def test_batches_and_outputs_keep_their_types_in_every_tree(world1, tmp_path):
    tok = tokenizer()
    batch = tf.DataCollatorWithPadding(tok)([tok(line) for line in LINES[:3]])
    net = model(len(tok))
    with pytest.raises(TypeError, match=r"tree\['out'\].*DynamicCache.*add_safe_globals"):
        pardist.checkpoint.save(tmp_path, {"out": net(**batch)}, step=1)  # a cache is code
    out = net(**batch, use_cache=False)
    saved = {"batch": batch, "out": out}
    path = pardist.checkpoint.save(tmp_path, saved, step=1)
    back = pardist.checkpoint.load(path, saved)
    assert type(back["batch"]) is type(batch) and type(back["out"]) is type(out)
    assert torch.equal(back["batch"]["input_ids"], batch["input_ids"])
    doubled = pardist.gather(batch)
    assert type(doubled) is type(batch) and list(doubled) == list(batch)


def _keys_differ():
    tok = tokenizer()
    batch = tf.DataCollatorWithPadding(tok)([tok(line) for line in LINES[:2]])
    if pardist.rank() == 1:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    step = pardist.data_parallel(
        lambda w, b: pardist.grad(lambda w: (w * b["input_ids"].sum()).sum())(w)
    )
    try:
        step(torch.ones(1, dtype=torch.float64), batch)
    except ValueError as e:
        return str(e)


def test_keys_that_differ_between_ranks_are_named(run):
    for message in run(2, _keys_differ):
        assert "args[1]['token_type_ids'] is only on rank 1" in message


def _compiled_hf_loss(compile: bool):  # noqa: A002 - data_parallel's word
    import warnings

    tok = tokenizer()
    net = model(len(tok))
    apply, params, _ = pardist.functional(net)
    start = {k: v.clone() for k, v in params.items()}
    opt = pardist.optim.sgd(0.1)
    state = opt.init(params)
    collate = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    batch = collate([tok(line) for line in LINES[pardist.rank() * 4 : pardist.rank() * 4 + 4]])

    @pardist.data_parallel(compile=compile)
    def step(p, s, b):
        def loss(p):  # Hugging Face's own loss: its loss_function logs (warning_once)
            return apply(p, {}, input_ids=b["input_ids"], labels=b["labels"])[0].loss

        value, g = pardist.value_and_grad(loss)(p)
        return (*opt.update(g, s, p), value)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            params, state, value = step(params, state, dict(batch))
    said = [str(c.message) for c in caught if "compile=True" in str(c.message)]
    graphs = step.compiled.backend.graphs if compile else 0
    return {k: params[k] - start[k] for k in params}, float(value), said, graphs


def test_a_hugging_face_loss_that_logs_compiles_in_one_graph(run):
    """HF's loss_function calls logger.warning_once, which stopped dynamo; a compiled step
    traces past logging calls. Both runs cast the logits to float32 in HF's loss (its
    ``logits.float()``), so they agree to float32's rounding of the loss's gradient (a
    relative 1e-5 over two steps, with room), not float64's."""
    eager = run(2, _compiled_hf_loss, False)
    for (p_c, v_c, said, graphs), (p_e, v_e, _, _) in zip(run(2, _compiled_hf_loss, True), eager):
        assert said == [] and graphs == 1
        assert abs(v_c - v_e) <= 1e-5 * abs(v_e)
        for k in p_e:  # the change of each weight over the two steps
            assert (p_c[k] - p_e[k]).abs().max() <= 1e-5 * p_e[k].abs().max() + 1e-15, k
