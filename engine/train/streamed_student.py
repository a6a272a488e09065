"""The streamed student: phases 2 and 3 for a model that does not fit dequantized.

The in-memory student (`student.py`) dequantizes the whole base, because backward through a
batch touches nearly every expert. But the LoRA trains only resident modules (attention, linear
attention, shared experts): the routed experts are frozen, and a gradient needs to pass through
them only to their input, and one expert at a time at that, so the experts can stay on disk
and go through the streaming engine's expert cache as in inference:

- **Forward.** The checkpoint is loaded as the streaming engine loads it (`on-demand`, on the
  prefill kernels the config asks for: dense fp32 products for experts with many rows on a CPU
  with a fast BLAS, the 4-bit kernel for the rest), and each MoE layer runs the student's
  routing (`StudentMoE`: the gate, or the heads' predictions) over the whole batch. A layer
  routed to more experts than the cache holds computes them a bankful at a time
  (`StreamingSwitchGLU._by_expert_groups`).
- **Backward.** Each layer's routed experts are one `mx.custom_function` (`TrainableExperts`)
  whose VJP reads that layer's experts again, a bankful at a time, and accumulates the input's
  gradient expert by expert through that expert's dequantized weights (`expert_input_grad`),
  each evaluated before the next, outside the layer's gradient transform (`untraced`). The
  routing weights' gradient flows as usual: they multiply the experts' outputs outside this
  function. The layer computed again for its backward takes its experts' output kept from the
  forward (tokens x K x hidden a layer) rather than running them a third time.

Memory is the resident weights, the expert cache, the LoRA with its optimizer state, each
layer's input and experts' output, and the activations autograd keeps of the resident modules;
no expert is ever held twice. The same
`Student` class runs on it, so losses, heads and LoRA files are those of the in-memory path
(tests/test_streamed_student.py: losses and LoRA gradients equal it within 1e-4 relative).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import replace
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..experts.switch_glu import StreamingSwitchGLU, dense_expert_glu
from ..runtime.layer_major import decoder_layer_list
from ..runtime.loader import LoadedModel


class TrainableExperts(nn.Module):
    """A layer's streamed routed experts as a differentiable function of their input: `[..., H]`
    and indices `[..., K]` -> `[..., K, H]`, as the family's `SwitchGLU` returns them."""

    def __init__(self, switch: StreamingSwitchGLU) -> None:
        super().__init__()
        self.switch = switch  # no parameters: its weights are the expert cache's slots
        experts = mx.custom_function(self._forward)
        experts.vjp(self._backward)
        self._experts = experts
        # `LayerwiseGrad`: the step's recorded forward keeps its output, and the backward's
        # recomputation of the layer takes it instead of running the experts again (a third
        # of a step's expert work).
        self.keep_output = False
        self.kept = KeptOutput()  # not an array attribute: a module would make it a parameter

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._experts(x, indices)

    def _forward(self, x: mx.array, indices: mx.array) -> mx.array:
        kept, self.kept.output = self.kept.output, None
        if kept is not None and not self.keep_output:
            # The layer computed again from the input it recorded this output at.
            assert kept.shape == (*indices.shape, x.shape[-1]), (kept.shape, indices.shape)
            return kept
        # Computed now, while this layer's experts are in their slots: the next layer's reads (or
        # a backward's, which starts before the loss is evaluated) may take the same slots.
        output = untraced(self.switch, x, indices)
        if self.keep_output:
            self.kept.output = output
        return output

    def _backward(
        self, primals: tuple[mx.array, mx.array], cotangent: mx.array, output: mx.array
    ) -> tuple[mx.array, mx.array]:
        x, indices = primals
        grad = untraced(expert_input_grad, self.switch, x, indices, cotangent)
        return grad, mx.zeros_like(indices)


class KeptOutput:
    """The routed experts' output of a layer's recorded forward, until its backward takes it."""

    output: mx.array | None = None


def untraced(function, *args):
    """`function(*args)` outside the gradient transform this thread is in (the layer's `mx.vjp`),
    on the one thread kept for it while this one waits; `function` returns one array. Inside a
    transform MLX keeps every intermediate of an evaluation alive until its output is freed,
    and that state is per thread: one wide expert's input gradient held three times as much
    there as outside (docs/notebook/figures-from-code-comments.md). The other thread gets copies of the array arguments: evaluating the transform's own
    arrays there cut them from its graph (the gradient came back zero). One thread for the
    process, not one per call: each new thread that ran the dense products left its own C heap
    and BLAS buffers behind (the process grew every step outside MLX)."""
    mx.eval(*[a for a in args if isinstance(a, mx.array)])
    args = tuple(detached(a) if isinstance(a, mx.array) else a for a in args)
    return _untraced_thread().submit(_evaluated, function, args).result()


def _evaluated(function, args) -> mx.array:
    output = function(*args)
    mx.eval(output)
    # A fresh array: MLX gives each thread its own stream, and an array this thread made
    # lazily cannot be evaluated on another ("There is no Stream(cpu, N)").
    return detached(output)


def detached(array: mx.array) -> mx.array:
    """An evaluated array as a fresh one, without the graph or the stream that made it. Costs
    one copy of the array."""
    return mx.array(np.array(array, copy=False))


@cache
def _untraced_thread() -> _Worker:
    return _Worker()


class _Worker:
    """One daemon thread that runs what it is given, one call at a time, and never ends: with a
    worker that had run MLX and was joined as the process exited (a `ThreadPoolExecutor`), 5
    exits of `edge0 train lora --student streamed` in 6 aborted after the LoRA was written
    ("terminate called without an active exception", status 134); with this one, none in 10.
    (The tiny test models never showed it: no test reproduces it.)"""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="edge0-untraced", daemon=True).start()

    def submit(self, function, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, function, args))
        return future

    def _run(self) -> None:
        while True:
            future, function, args = self._calls.get()
            try:
                future.set_result(function(*args))
            except BaseException as error:  # raised again by the caller's `result()`
                future.set_exception(error)


def expert_input_grad(
    switch: StreamingSwitchGLU, x: mx.array, indices: mx.array, cotangent: mx.array
) -> mx.array:
    """d(loss)/dx of the experts' outputs, the layer's experts read again a bankful at a time:
    each expert's rows are differentiated through that expert's dequantized weights (fp32 GEMMs,
    as the in-memory student computes) and their gradients added into the rows they came from,
    one expert evaluated at a time, each group before the next takes the slots.

    One expert at a time, not through the 4-bit kernel: MLX's gradient of `gather_qmm` with
    respect to its input held several times what the forward did, in every layer, past the plan
    (docs/notebook/figures-from-code-comments.md)."""
    store, layer = switch.store, switch.layer
    mx.eval(x, indices, cotangent)
    routed = np.array(indices)
    k = routed.shape[-1]
    hidden = x.shape[-1]
    flat_x = x.reshape(-1, hidden)
    flat_cotangent = cotangent.reshape(-1, cotangent.shape[-1])  # one row per assignment
    experts = routed.reshape(-1)
    distinct = np.unique(experts)
    grad = mx.zeros_like(flat_x)
    for group, slots, bank in store.bankfuls(layer, distinct.tolist()):
        for expert, slot in zip(group, slots):
            ids = np.flatnonzero(experts == expert)
            glu = partial(dense_expert_glu, switch, bank=bank, slot=int(slot))
            grad = _add_row_grads(grad, glu, flat_x, flat_cotangent, ids, k)  # evaluated
    return grad.reshape(x.shape)


def _add_row_grads(grad, glu, flat_x, flat_cotangent, assignments, k) -> mx.array:
    """`grad` plus the gradient of the rows of `assignments` through `glu` (one output row per
    assignment), evaluated."""
    rows = mx.array((assignments // k).astype(np.uint32))  # the token each assignment is of
    cotangent = flat_cotangent[mx.array(assignments)]
    _, (row_grads,) = mx.vjp(glu, [flat_x[rows]], [cotangent])
    grad = grad.at[rows].add(row_grads)
    mx.eval(grad)
    return grad


def trainable_experts(layer: nn.Module) -> list[TrainableExperts]:
    """The streamed routed experts of a decoder layer (none in a dense layer)."""
    return [m for _, m in layer.named_modules() if isinstance(m, TrainableExperts)]


def make_experts_trainable(loaded: LoadedModel) -> None:
    """Put `TrainableExperts` around every MoE layer's streamed experts (before the `Student`
    takes the layers' children)."""
    for site in loaded.sites:
        switch = getattr(site.parent, site.attribute)
        if not isinstance(switch, StreamingSwitchGLU):
            raise TypeError(f"layer {site.layer}: experts are not streamed ({type(switch)})")
        setattr(site.parent, site.attribute, TrainableExperts(switch))


def streaming_config(engine_config):
    """The engine config a streamed student loads with: streamed experts, on the kernels the
    config asks for (on a CPU with a fast BLAS, dense fp32 products for experts with many rows)."""
    return replace(engine_config, mode="on-demand")


# -- the training step, a layer at a time ------------------------------------------------------------


class _Recorder:
    """What the taps do in each pass of `LayerwiseGrad`, and what they keep."""

    def __init__(self, plan) -> None:
        self.plan = (
            plan  # the student's `_Plan`: predictions between layers, `base` for the teacher
        )
        self.mode = "off"  # "record": keep each layer's input; "replay": skip the layers
        self.inputs: dict[int, tuple[mx.array, tuple, dict]] = {}
        self.predicted_in: dict[int, mx.array] = {}  # consumer layer -> the prediction it routed by
        self.last_output: mx.array | None = None
        self.variable: mx.array | None = None  # what the last layer returns in "replay"


class _Tap:
    """Stands in a decoder layer's place in the model's list during one training step. Not an
    `nn.Module`: it is never in the parameter tree (it is taken out before the optimizer runs)."""

    def __init__(self, index: int, layer: nn.Module, last: bool, recorder: _Recorder) -> None:
        self.index, self.layer, self.last, self.recorder = index, layer, last, recorder
        self.experts = trainable_experts(layer)

    def __getattr__(self, name: str):
        return getattr(self.layer, name)  # what the model's loop asks of a layer (`is_linear`)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        recorder = self.recorder
        if recorder.plan.base or recorder.mode == "off":  # the teacher's forward: untouched
            return self.layer(x, *args, **kwargs)
        if recorder.mode == "replay":
            return recorder.variable if self.last else x
        predicted = recorder.plan.predicted.get(self.index)
        mx.eval(x) if predicted is None else mx.eval(x, predicted)
        recorder.inputs[self.index] = (x, args, kwargs)
        if predicted is not None:
            recorder.predicted_in[self.index] = predicted
        for experts in self.experts:  # the student's recorded forward only, not a teacher's
            experts.keep_output = True
        try:
            y = self.layer(x, *args, **kwargs)
        finally:
            for experts in self.experts:
                experts.keep_output = False
        if self.last:
            mx.eval(y)
            recorder.last_output = y
        return y


class LayerwiseGrad:
    """`loss_fn`'s value and its gradients on the student's trainable parameters (the LoRA), as
    `nn.value_and_grad(student.model, loss_fn)` gives them, in bounded memory:

    1. forward, no gradient: each decoder layer's input (and the prediction it routes by) kept;
    2. the loss's gradient at the last layer's output (the layers skipped: `_Tap` "replay");
    3. from the last layer down: the layer computed again from its input and differentiated,
       its experts read again (`TrainableExperts`); its input's gradient feeds the layer below,
       its prediction's gradient the layer that made it.

    `loss_fn(*batch)` must run the student's forward once (`student(tokens, gate_prefix)`); a
    teacher's logits are computed outside it."""

    def __init__(self, student, loss_fn) -> None:
        self.student, self.loss_fn = student, loss_fn

    def __call__(self, *batch):
        student = self.student
        layers = decoder_layer_list(student.model)
        recorder = _Recorder(student.routing_plan)
        originals = list(layers)
        for index, layer in enumerate(originals):
            layers[index] = _Tap(index, layer, index == len(originals) - 1, recorder)
        try:
            # 1. forward: the checkpoints, and each layer's routed experts' output.
            recorder.mode = "record"
            mx.eval(self.loss_fn(*batch))
            if len(recorder.inputs) != len(originals) or recorder.last_output is None:
                raise RuntimeError("the model did not call every decoder layer in order")
            positions = student.routing_plan.predicted_positions
            # 2. the loss at the last layer's output.
            recorder.mode = "replay"

            def head(output: mx.array) -> mx.array:
                recorder.variable = output
                return self.loss_fn(*batch)

            (loss,), (grad,) = mx.vjp(head, [recorder.last_output], [mx.array(1.0)])
            mx.eval(loss, grad)
        finally:
            recorder.mode = "off"
            layers[:] = originals
        # 3. the layers, last to first (each takes its experts' kept output).
        grads: list[tuple[str, mx.array]] = []
        prediction_grads: dict[int, mx.array] = {}
        paths = {id(module): path for path, module in student.model.named_modules()}
        try:
            for index in reversed(range(len(originals))):
                layer = originals[index]
                grad, layer_grads = self._layer_backward(
                    index, layer, recorder, positions, grad, prediction_grads
                )
                prefix = paths[id(layer)]
                grads += [(f"{prefix}.{name}", g) for name, g in layer_grads]
        finally:  # none left for a later forward (a step that failed part way)
            for layer in originals:
                for module in trainable_experts(layer):
                    module.kept.output = None
        return loss, tree_unflatten(grads)

    def _layer_backward(self, index, layer, recorder, positions, grad, prediction_grads):
        """One layer's input gradient and its LoRA's, from its output's (and, on an owner of
        heads, its prediction's) gradient."""
        plan = self.student.routing_plan
        x, args, kwargs = recorder.inputs[index]
        predicted_in = recorder.predicted_in.get(index)
        consumer = self._consumer_of(index)
        params = tree_flatten(layer.trainable_parameters())
        names = [name for name, _ in params]
        originals = [value for _, value in params]

        def forward(x: mx.array, *rest: mx.array) -> list[mx.array]:
            if predicted_in is not None:
                predicted, rest = rest[0], rest[1:]
            layer.update(tree_unflatten(list(zip(names, rest))))
            plan.base, plan.k, plan.predicted_positions = False, self.student.k, positions
            plan.predicted = {index: predicted} if predicted_in is not None else {}
            y = layer(x, *args, **kwargs)
            made = plan.predicted.pop(consumer, None) if consumer is not None else None
            plan.predicted = {}
            return [y] if made is None else [y, made]

        primals = [x, *([predicted_in] if predicted_in is not None else []), *originals]
        cotangents = [grad]
        if consumer is not None:
            cotangents.append(prediction_grads.pop(consumer))
        with self.student.step():
            try:
                _, input_grads = mx.vjp(forward, primals, cotangents)
                mx.eval(input_grads)
            finally:
                layer.update(tree_unflatten(list(zip(names, originals))))
        grad, rest = input_grads[0], input_grads[1:]
        if predicted_in is not None:
            prediction_grads[index], rest = rest[0], rest[1:]
        return grad, list(zip(names, rest))

    def _consumer_of(self, index: int) -> int | None:
        """The layer whose routing this layer's heads predict (None: it owns no head)."""
        heads = self.student.heads
        if heads is None or index not in heads.owners:
            return None
        return heads.consumers[list(heads.owners).index(index)]
