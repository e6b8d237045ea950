"""Custom losses run on the server: a loss the SDK traced (its own tracer and encoder) is checked against the
allow-lists, runs in the trainer's pass beside another adapter's cross_entropy, and equals the SDK's client-side path
(a forward, the loss and its gradient in the client, a backward with linearized weights) in loss and gradients; a
graph that is not a loss over torch operations is refused, naming the node."""

import copy

import numpy as np
import pytest
import torch

from helpers import backend_with, weighted_datum
from lilo.backend.training.loss_graph import MAX_NODES, parse_loss_graph
from lilo.backend.types import Datum, LoraSpec, TrainInput
from lilo.engine.commands import Command, Kind
from lilo.errors import InvalidRequestError


def ppo_like(logprobs, sampler_logprobs, advantages):
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = ratio.clamp(0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    length = logprobs.shape[0]
    penalty = torch.nn.functional.softplus(logprobs[1:] - sampler_logprobs[: length - 1]).mean()
    return loss + 0.1 * penalty, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": ratio.new_ones(()).sum()}


RANKS = {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}


def traced(fn=ppo_like, ranks=RANKS):
    """The SDK's handle and the graph as it uploads it (``create_custom_loss``'s body)."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, "session")
    uploaded = {"name": handle.name, "inputs": [i.model_dump() for i in handle.inputs],
                "graph": encode_graph(handle).model_dump(mode="json")}
    return handle, uploaded


def rl_datum(seed: int, length: int = 20) -> Datum:
    rng = np.random.default_rng(seed)
    base = weighted_datum(seed, length)
    return Datum(tokens=base.tokens, loss_inputs={
        "target_tokens": base.loss_inputs["target_tokens"],
        "sampler_logprobs": rng.normal(-6.5, 0.3, length).astype(np.float32),
        "advantages": rng.normal(0, 1, length).astype(np.float32)})


def step(model_id, seq, data, loss_fn="cross_entropy", custom=None, forward_only=False) -> Command:
    train = TrainInput(data=data, loss_fn=loss_fn, custom_loss=custom)
    return Command(model_id, seq, Kind.FORWARD if forward_only else Kind.FORWARD_BACKWARD, f"{model_id}:{seq}",
                   payload=train, tokens=train.tokens)


def test_a_traced_loss_runs_in_the_pass_and_equals_the_sdks_client_side_path(base):
    from tinker import types
    from tinker.lib.public_interfaces.custom_loss import run_loss_handle

    handle, uploaded = traced()
    graph = parse_loss_graph(**uploaded)
    data = [rl_datum(1), rl_datum(2, length=13)]
    specs = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=4, seed=2)}
    server, client = backend_with(base, specs, max_adapters=4, max_rank=8), backend_with(base, specs, max_adapters=4,
                                                                                        max_rank=8)
    # Server-side: one pass holds a's custom loss and b's cross_entropy.
    custom, cross = server.forward_backward([step("a", 1, data, "custom", graph),
                                             step("b", 1, [weighted_datum(9, 16)])], False)
    # Client-side, as the SDK runs it: forward, the loss and its gradient here, then a linearized backward.
    surrogate = [Datum(tokens=d.tokens, loss_inputs={"target_tokens": d.loss_inputs["target_tokens"],
                                                     "weights": np.zeros(len(d.tokens), np.float32)}) for d in data]
    forward = client.forward_backward([step("a", 1, surrogate, forward_only=True)], True)[0]
    logprobs = [torch.tensor(out["logprobs"], dtype=torch.float32, requires_grad=True)
                for out in forward["loss_fn_outputs"]]
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(list(d.tokens)),
                            loss_fn_inputs={key: np.asarray(value) for key, value in d.loss_inputs.items()})
                for d in data]
    loss, metrics = run_loss_handle(handle, sdk_data, logprobs)
    loss.backward()
    linearized = [Datum(tokens=d.tokens, loss_inputs={"target_tokens": d.loss_inputs["target_tokens"],
                                                      "weights": (-lp.grad).numpy()}) for d, lp in zip(data, logprobs)]
    client.forward_backward([step("a", 2, linearized)], False)

    assert custom["metrics"]["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    assert custom["metrics"]["custom/ratio:mean"] == pytest.approx(metrics["custom/ratio:mean"], rel=1e-5)
    assert custom["metrics"]["custom/tokens:sum"] == metrics["custom/tokens:sum"] == 2.0
    # fp32: the two paths sum the same terms in different orders (a few elements of 166K differ by ~1e-7).
    expected = client.bank.grads[client.adapters["a"].slot]
    torch.testing.assert_close(server.bank.grads[server.adapters["a"].slot], expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))
    assert "elementwise_loss" not in custom["loss_fn_outputs"][0] and cross["metrics"]["loss:sum"] > 0


def test_a_loss_that_does_not_fit_its_data_fails_its_request_alone(base):
    def wants_a_matrix(logprobs, advantages):
        return (logprobs * advantages[:, 0]).sum(), {}

    graph = parse_loss_graph(**traced(wants_a_matrix, {"logprobs": 1, "advantages": 1})[1])
    backend = backend_with(base, {"a": LoraSpec(rank=4), "b": LoraSpec(rank=4)}, max_adapters=4, max_rank=8)
    failed, ok = backend.forward_backward([step("a", 1, [rl_datum(3)], "custom", graph),
                                           step("b", 1, [weighted_datum(4, 16)])], False)
    assert isinstance(failed, InvalidRequestError) and "failed on datum 0" in str(failed)
    assert ok["metrics"]["loss:sum"] > 0


def node(op, name, target, args=(), kwargs=None):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs or {}}


def graph_of(*middle, output=None):
    nodes = [node("placeholder", "logprobs", "logprobs"), *middle,
             node("output", "output", "output", [output or {"tuple": [{"ref": "logprobs"}, {"dict": {}}]}])]
    return {"name": "evil", "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes}}


@pytest.mark.parametrize("uploaded, named", [
    (graph_of(node("call_function", "boom", "os.system", ["rm -rf /"])), "'boom' calls 'os.system'"),
    (graph_of(node("call_function", "e", "builtins.eval", ["1"])), "'e' calls 'builtins.eval'"),
    (graph_of(node("call_method", "host", "item", [{"ref": "logprobs"}])), "'host' calls 'item'"),
    (graph_of(node("call_method", "b", "backward", [{"ref": "logprobs"}])), "'b' calls 'backward'"),
    (graph_of(node("call_module", "m", "linear", [{"ref": "logprobs"}])), "'m' is a 'call_module' node"),
    (graph_of(node("get_attr", "w", "weight")), "'w' is a 'get_attr' node"),
    (graph_of(node("call_function", "g", "getattr", [{"ref": "logprobs"}, "__class__"])), "'g' reads an attribute"),
    (graph_of(node("call_function", "x", "torch.exp", [{"ref": "later"}])), "refers to 'later'"),
    (graph_of(node("call_function", "p", "torch.exp", [{"pickle": "gASVAAAA"}])), "'p' passes a 'pickle'"),
    (graph_of(output={"tuple": [{"ref": "logprobs"}, {"dict": {"loss": {"ref": "logprobs"}}}]}), "metric 'loss'"),
    (graph_of(*[node("call_function", f"n{i}", "torch.exp", [{"ref": "logprobs"}]) for i in range(MAX_NODES)]),
     f"1 to {MAX_NODES} nodes"),
])
def test_a_graph_that_is_not_a_loss_of_allowed_operations_is_refused_naming_the_node(uploaded, named):
    with pytest.raises(InvalidRequestError, match=named.replace("(", r"\(")):
        parse_loss_graph(**copy.deepcopy(uploaded))


def test_a_huge_tensor_is_stopped_before_anything_computes_on_it(base):
    uploaded = graph_of(node("call_method", "big", "expand", [{"ref": "logprobs"}, 100_000, -1]),
                        node("call_method", "s", "sum", [{"ref": "big"}]),
                        output={"tuple": [{"ref": "s"}, {"dict": {}}]})
    graph = parse_loss_graph(**uploaded)
    backend = backend_with(base, {"a": LoraSpec(rank=4)}, max_adapters=2, max_rank=8)
    (refused,) = backend.forward_backward([step("a", 1, [rl_datum(5, length=400)], "custom", graph)], False)
    assert isinstance(refused, InvalidRequestError) and "over the 16777216" in str(refused)
