"""``functional(model, remat=...)`` on Hugging Face decoders: every policy, the same gradients.

Tiny Llama, Qwen2, Mistral and GPT-2 (rotary ``inv_freq`` buffers, a key-value cache on
by default) in float64: every remat policy gives the gradients of no checkpointing. A
selective policy recomputes exactly the ops it did not keep, so pardist's own work in a
recomputation (copies of the buffers) must stay out of the region torch watches, and the
cache (which the recomputation would write again) is turned off in pardist's copy of the
model, with a warning, as Hugging Face's gradient checkpointing does; asked for in the
call, it is an error naming ``use_cache=False``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers as tf  # noqa: E402
from numerics import assert_close64  # noqa: E402

import pardist  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
MODELS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, **HEADS)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, **HEADS)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL, **HEADS)),
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    ),
}
POLICIES = ["nothing_saveable", "dots_saveable", "everything_saveable"]


def _grads(name: str, policy: str | None) -> dict:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    apply, params, buffers = pardist.functional(model, remat=policy)

    def loss(p):
        return apply(p, buffers, input_ids=ids, labels=ids)[0].loss

    return pardist.grad(loss)(params)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_policy_gives_the_gradients_of_no_checkpointing(name):
    want = _grads(name, None)
    for policy in POLICIES:
        if policy == "everything_saveable":
            got = _grads(name, policy)
        else:
            with pytest.warns(UserWarning, match="use_cache=True is incompatible with activation"):
                got = _grads(name, policy)
        assert_close64(got, want, f"{name}, {policy}")


def test_a_cache_asked_for_is_an_error_naming_the_fix():
    model = MODELS["gpt2"]().double()
    model.config.use_cache = False  # (no warning: the config already says so)
    apply, params, buffers = pardist.functional(model, remat="dots_saveable")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="use_cache=True with remat=.*Pass use_cache=False"):
        apply(params, buffers, input_ids=ids, use_cache=True)
