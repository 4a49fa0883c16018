"""The model zoo: tiny, randomly initialised third-party models, their batches and losses.

Each entry builds its model with a fixed seed (so every process builds the same
one), makes global batch ``s`` deterministically, and computes the loss from the
model's output as a user would. Nothing is downloaded: timm and torchvision
models are created without weights, transformers models from small configs.
Dropout is off everywhere: its masks differ between ranks and one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8  # global batch: 4 rows per rank at 2 ranks
CLASSES = 10
VOCAB = 128


@dataclasses.dataclass
class Entry:
    build: Callable[[], nn.Module]
    kind: str  # 'image', 'classify' (token ids -> class), 'lm', 'seq2seq', 'vector'
    channels_last: bool = False
    size: int = 32  # image side
    # Ill-conditioned under AdamW (per-element normalisation amplifies the rounding
    # of small gradients): compared within 3x of plain torch's own rounding floor.
    floor: bool = False
    what: str = ""  # what it exercises, for the README table


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        import timm

        return timm.create_model(name, num_classes=CLASSES, drop_rate=0.0, **kwargs)

    return build


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return getattr(torchvision.models, name)(num_classes=CLASSES, **kwargs)

    return build


def _without_max_pool(name: str) -> Callable[[], nn.Module]:
    # On random inputs the stem's max pool meets near-ties that send gradients one
    # way or the other on rounding alone: there, plain torch in float32 and in
    # float64 differ by 4% (shufflenet), and any change of summation order (such as
    # splitting the batch) flips some. Without it the models are well-conditioned.
    def build():
        model = _torchvision(name)()
        model.maxpool = nn.Identity()
        return model

    return build


def _bert():
    import transformers as tf

    config = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return tf.BertForSequenceClassification(config)


def _gpt2():
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config)  # lm_head.weight is wte.weight


def _llama():
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config)


def _t5():
    import transformers as tf

    config = tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(config)  # shared embeddings, tied lm_head


class _ScaledBatchNorm(nn.BatchNorm1d):
    """A user's subclass with its own forward: batch norm, then a learned-free scale."""

    def forward(self, x):
        return 2.0 * super().forward(x)


class _DirectNorm(nn.Module):
    """Calls F.batch_norm itself, with its own running statistics."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("var", torch.ones(n))

    def forward(self, x):
        return F.batch_norm(x, self.mean, self.var, training=self.training, momentum=0.2)


class DictNet(nn.Module):
    """Returns a dict; has a parameter it never uses; normalises three ways."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU())
        self.user_norm = _ScaledBatchNorm(32)
        self.direct = _DirectNorm(32)
        self.head = nn.Linear(32, CLASSES)
        self.unused = nn.Linear(32, CLASSES)  # never called: its gradient is zero

    def forward(self, x):
        h = self.direct(torch.tanh(self.user_norm(self.body(x))))
        return {"logits": self.head(h), "features": h}


MODELS: dict[str, Entry] = {
    # timm: BatchNormAct2d (activation and drop inside the norm's own forward)
    "timm/test_efficientnet": Entry(
        _timm("test_efficientnet"), "image", floor=True, what="BatchNormAct2d (SiLU), SE"
    ),
    "timm/mobilenetv3_small_050": Entry(
        _timm("mobilenetv3_small_050"), "image", floor=True, what="BatchNormAct2d (Hardswish)"
    ),
    "timm/regnetx_002": Entry(_timm("regnetx_002"), "image", what="BatchNormAct2d (ReLU), groups"),
    "timm/test_nfnet": Entry(
        _timm("test_nfnet"), "image", what="F.batch_norm on weights (ScaledStdConv2d)"
    ),
    "timm/test_vit": Entry(_timm("test_vit", img_size=32), "image", what="ViT, LayerNorm"),
    "timm/test_convnext": Entry(
        _timm("test_convnext"), "image", what="ConvNeXt, non-contiguous gradients"
    ),
    # torchvision
    "torchvision/resnet18": Entry(
        _without_max_pool("resnet18"), "image", floor=True, what="BatchNorm2d"
    ),
    "torchvision/mobilenet_v3_small (channels_last)": Entry(
        _torchvision("mobilenet_v3_small", dropout=0.0),
        "image",
        channels_last=True,
        what="channels_last parameters and gradients",
    ),
    "torchvision/shufflenet_v2_x0_5": Entry(
        _without_max_pool("shufflenet_v2_x0_5"), "image", floor=True, what="channel shuffle"
    ),
    # transformers
    "transformers/bert": Entry(_bert, "classify", what="encoder, ModelOutput"),
    "transformers/gpt2": Entry(_gpt2, "lm", what="decoder, tied embeddings, Conv1D"),
    "transformers/llama": Entry(_llama, "lm", what="decoder, tied embeddings, RMSNorm, RoPE"),
    "transformers/t5": Entry(_t5, "seq2seq", what="encoder-decoder, shared embeddings"),
    # a dict output, an unused parameter, a user BN subclass and a direct F.batch_norm
    "custom/dictnet": Entry(
        DictNet, "vector", what="dict output, unused parameter, BN subclass, F.batch_norm"
    ),
}


def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    entry = MODELS[name]
    torch.manual_seed(0)
    model = entry.build().to(dtype)
    if entry.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def batch(name: str, step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Global batch ``step`` of model ``name``: a dict of tensors with BATCH rows."""
    b = _batch(name, step)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()}


def _batch(name: str, step: int) -> dict[str, torch.Tensor]:
    entry = MODELS[name]
    g = torch.Generator().manual_seed(100 + step)
    if entry.kind == "image":
        x = torch.randn(BATCH, 3, entry.size, entry.size, generator=g)
        if entry.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return {"x": x, "y": torch.randint(0, CLASSES, (BATCH,), generator=g)}
    if entry.kind == "vector":
        x = torch.randn(BATCH, 16, generator=g) * 2 + 1
        return {"x": x, "y": torch.randint(0, CLASSES, (BATCH,), generator=g)}
    ids = torch.randint(0, VOCAB, (BATCH, 12), generator=g)
    if entry.kind == "classify":
        return {"input_ids": ids, "y": torch.randint(0, CLASSES, (BATCH,), generator=g)}
    if entry.kind == "lm":
        return {"input_ids": ids}
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, 6), generator=g)}


def shard(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world)[rank] for k, v in b.items()}


def forward(call: Callable, kind: str, b: dict[str, torch.Tensor]):
    """The model's output, called as a user calls it (``call(*args, **kwargs)``)."""
    if kind in ("image", "vector"):
        return call(b["x"])
    if kind == "classify":
        return call(input_ids=b["input_ids"])
    if kind == "lm":
        return call(input_ids=b["input_ids"], labels=b["input_ids"])
    return call(input_ids=b["input_ids"], labels=b["labels"])


def loss_of(out, kind: str, b: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind in ("lm", "seq2seq"):
        return out.loss  # transformers' own cross-entropy, a mean over the shard's tokens
    logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
    return F.cross_entropy(logits, b["y"])
