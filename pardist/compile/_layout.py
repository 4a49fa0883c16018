"""One layout for a conv net's activations in the whole-step graph.

Inductor runs a graph's convolutions channels_last ("layout optimization": always
where oneDNN runs them on CPUs, by its heuristics on GPUs) and chooses the layout of
the graph's own tensors to suit. One rule overrides it: a tensor that
``convolution_backward`` reads keeps the strides tracing gave it (``need_fixed_layout``
in ``torch/_inductor/graph.py``), which are the model's NCHW.

In the graph ``torch.compile(model)`` makes that rule costs nothing: AOTAutograd splits
it into a forward and a backward, and the backward reads the activations the forward
saved, already channels_last. The whole-step graph differentiates with torch.func in
the same graph, so the rule applies to every activation a convolution reads. Each is
then written three times (NCHW for the rule, a channels_last copy for the convolution,
another for its backward) and the batch norm's backward reads it transposed: the
pointwise kernels of a small conv net took 2.5x the time of torch.compile(model)'s
(27.6 against 11.0 ms a step on 2 vCPUs, torch 2.13).

:func:`_channels_last_activations`, run before inductor lowers the graph, gives those
activations the channels_last strides inductor would give them anyway, as the split
graph's backward receives them. Only the strides of the graph's own intermediate
tensors change (never an input's, an output's or a view's), so every value is the same
arithmetic; a batch norm's sums may add in another order, within float rounding.
"""

from __future__ import annotations

import torch
import torch.fx

from pardist.runtime import inductor_graph_pass, inductor_layout_opt

__all__ = ["one_layout"]

_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default


def _nchw_intermediate(node: torch.fx.Node) -> bool:
    """A 4-d NCHW tensor the graph computes itself and nothing outside it sees."""
    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and not getattr(node.target, "is_view", True)  # an OpOverload that makes new memory
        and isinstance(val, torch.Tensor)
        and val.dim() == 4
        and val.is_contiguous()
        and not val.is_contiguous(memory_format=torch.channels_last)
        and all(user.op != "output" for user in node.users)
    )


def _channels_last_activations(graph: torch.fx.Graph) -> None:
    """Give the activations a convolution's backward reads, and the gradients of the
    convolutions' outputs, channels_last strides: in a graph that also runs the
    convolutions (differentiated inside itself), where inductor runs them channels_last."""
    backward = [n for n in graph.nodes if n.target is _CONV_BACKWARD]
    if not backward or not any(n.target is _CONV for n in graph.nodes):
        return
    if not inductor_layout_opt(graph.owning_module):
        return
    for node in backward:
        for x in node.args[:2]:  # the output's gradient, the activation
            if isinstance(x, torch.fx.Node) and _nchw_intermediate(x):
                x.meta["val"] = x.meta["val"].contiguous(memory_format=torch.channels_last)


def one_layout():
    """:func:`_channels_last_activations` as inductor's ``post_grad_custom_pre_pass``."""
    return inductor_graph_pass(_channels_last_activations, (__file__,))
