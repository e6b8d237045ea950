"""Custom losses run on the server (the SDK's ``create_custom_loss`` with ``custom_loss_server_side``): a traced
loss arrives as plain data, node by node as torch.fx recorded it (``CustomLossGraph``), and is data here too.

``parse_loss_graph`` checks an uploaded graph and keeps it as a ``LossGraph``: every function, tensor method and
attribute it names must be on this module's allow-lists (elementwise math, reductions, shapes and indexing: what a
loss over a datum's log-probabilities needs, nothing that reaches files, processes, modules or Python objects),
every reference must name an earlier node, and its size is bounded. Anything else is refused with a sentence that
names the offending node. Nothing is ever unpickled, evaluated or compiled: ``run_loss_graph`` walks the nodes and
calls the allowed torch functions itself. Checking needs no torch, so the API front refuses a bad graph before it is
recorded; running imports it.

A loss takes one datum: ``logprobs`` (the target tokens' log-probabilities, ``[T]`` or ``[T, K]``, with gradient)
and the ``loss_fn_inputs`` it names, and returns a scalar loss and scalar metrics named ``custom/<name>:sum`` or
``custom/<name>:mean`` (how they combine over a request's datums). A request's loss is the sum of its datums'.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from lilo.errors import InvalidRequestError

MAX_NODES = 2000
MAX_INPUTS = 16
MAX_DEPTH = 8  # nesting of one argument (lists in tuples in dicts ...)
MAX_ITEMS = 64  # elements of one list, tuple or dict argument
MAX_TEXT = 128  # characters of one string argument
# Elements a value may hold: a new_zeros / new_ones / new_full asking for more is refused before it allocates; an
# expand past it is stopped before anything computes on it. (A broadcast of two long vectors is not foreseen.)
MAX_ELEMENTS = 1 << 24

_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

_ELEMENTWISE = ("exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt", "rsqrt", "square", "abs", "neg", "sign",
                "sigmoid", "tanh", "relu", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "where",
                "pow", "mul", "add", "sub", "div", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or",
                "logical_not", "isfinite", "isnan", "nan_to_num", "logaddexp")
_REDUCTIONS = ("min", "max", "sum", "mean", "prod", "logsumexp", "softmax", "log_softmax", "cumsum", "var", "std",
               "all", "any", "gather")
# call_function targets, as the SDK names them (torch.fx's qualified names; Python's operators as ``operator.*``).
FUNCTIONS = frozenset(
    [f"torch.{name}" for name in (*_ELEMENTWISE, *_REDUCTIONS, "stack", "cat", "zeros_like", "ones_like",
                                  "full_like", "numel")]
    + [f"torch.nn.functional.{name}" for name in ("relu", "softplus", "logsigmoid", "log_softmax", "softmax",
                                                  "sigmoid", "mse_loss", "smooth_l1_loss", "huber_loss")]
    + ["torch._C._nn.softplus", "torch._C._nn.log_sigmoid", "torch._C._nn.mse_loss", "torch._C._nn.huber_loss",
       "torch._C._nn.smooth_l1_loss"]
    + [f"operator.{name}" for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
                                       "getitem", "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor",
                                       "invert")]
    + [f"math.{name}" for name in ("log", "exp", "sqrt", "log1p", "expm1", "tanh", "floor", "ceil")]
    + ["getattr"])
# call_method targets: torch.Tensor methods.
METHODS = frozenset(_ELEMENTWISE + _REDUCTIONS + (
    "detach", "float", "double", "to", "type_as", "size", "dim", "numel", "unsqueeze", "squeeze", "view", "reshape",
    "flatten", "transpose", "permute", "t", "contiguous", "expand", "expand_as", "view_as", "reshape_as",
    "masked_fill", "new_zeros", "new_ones", "new_full"))
# What ``getattr`` may read of a tensor.
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT", "device"})
DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format"})
_NEW_TENSORS = frozenset({"new_zeros", "new_ones", "new_full"})


@dataclasses.dataclass(frozen=True)
class Ref:
    """An earlier node's value."""

    name: str


@dataclasses.dataclass(frozen=True)
class TorchName:
    """A torch constant by its name: a dtype or a memory format."""

    name: str


@dataclasses.dataclass(frozen=True)
class Device:
    """A device the client traced with; the loss runs on the logprobs' device, whatever it names."""


@dataclasses.dataclass(frozen=True)
class Node:
    op: str  # placeholder | call_function | call_method | output
    name: str
    target: str
    args: tuple
    kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class LossGraph:
    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), logprobs first
    nodes: tuple[Node, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys it reads, in the order it takes them."""
        return tuple(name for name, _ in self.inputs[1:])


def parse_loss_graph(name: str, inputs: Sequence[Mapping[str, Any]], graph: Mapping[str, Any]) -> LossGraph:
    """The uploaded loss, checked; InvalidRequestError, naming the node, for anything not allowed."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TEXT:
        raise InvalidRequestError(f"A custom loss needs a name of 1 to {MAX_TEXT} characters.")
    declared = _inputs(inputs)
    if graph.get("format", 1) != 1:
        raise InvalidRequestError(f"Custom loss graph format {graph.get('format')!r} is not known here; send format 1.")
    raw_nodes = graph.get("nodes")
    if not isinstance(raw_nodes, list) or not 0 < len(raw_nodes) <= MAX_NODES:
        raise InvalidRequestError(f"A custom loss graph holds 1 to {MAX_NODES} nodes.")
    seen: set[str] = set()
    nodes = []
    for raw in raw_nodes:
        node = _node(raw, seen)
        seen.add(node.name)
        nodes.append(node)
    placeholders = [node.target for node in nodes if node.op == "placeholder"]
    if placeholders != [input_name for input_name, _ in declared]:
        raise InvalidRequestError(f"The graph's inputs ({', '.join(placeholders)}) are not the declared ones "
                                  f"({', '.join(input_name for input_name, _ in declared)}), in order.")
    if [node.op for node in nodes].count("output") != 1 or nodes[-1].op != "output":
        raise InvalidRequestError("A custom loss graph ends in exactly one output node.")
    _check_output(nodes[-1])
    return LossGraph(name, declared, tuple(nodes))


def _inputs(inputs: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_INPUTS:
        raise InvalidRequestError(f"A custom loss takes 1 to {MAX_INPUTS} inputs, logprobs first.")
    declared = tuple((item.get("name"), item.get("rank")) for item in inputs if isinstance(item, dict))
    if len(declared) != len(inputs) or not all(isinstance(name, str) and _INPUT_NAME.fullmatch(name)
                                               and rank in (0, 1, 2) for name, rank in declared):
        raise InvalidRequestError("Each custom loss input is {name, rank}: a lowercase name and a rank of 0, 1 or 2.")
    if declared[0][0] != "logprobs" or declared[0][1] not in (1, 2):
        raise InvalidRequestError("A custom loss's first input is logprobs, of rank 1 ([T]) or 2 ([T, K]).")
    if len({name for name, _ in declared}) != len(declared):
        raise InvalidRequestError("A custom loss names each input once.")
    return declared


def _node(raw: Any, seen: set[str]) -> Node:
    if not isinstance(raw, dict):
        raise InvalidRequestError("Each custom loss graph node is an object {op, name, target, args, kwargs}.")
    op, name, target = raw.get("op"), raw.get("name"), raw.get("target")
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name) or name in seen:
        raise InvalidRequestError(f"Custom loss node name {name!r} is not a new identifier.")
    if not isinstance(target, str) or len(target) > MAX_TEXT:
        raise InvalidRequestError(f"Custom loss node {name!r} has no target.")
    allowed = {"placeholder": None, "call_function": FUNCTIONS, "call_method": METHODS, "output": {"output"}}
    if op not in allowed:
        raise InvalidRequestError(f"Custom loss node {name!r} is a {op!r} node; a loss on the server is made of "
                                  "inputs, calls of allowed torch functions and tensor methods, and its output.")
    if allowed[op] is not None and target not in allowed[op]:  # type: ignore[operator]
        what = "function" if op == "call_function" else "tensor method"
        raise InvalidRequestError(f"Custom loss node {name!r} calls {target!r}, which is not an allowed {what} "
                                  "(docs/losses.md lists them); rewrite the loss with allowed torch operations.")
    args, kwargs = raw.get("args", []), raw.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidRequestError(f"Custom loss node {name!r} has malformed args or kwargs.")
    node = Node(op, name, target, tuple(_arg(name, arg, seen, 0) for arg in args),
                {str(key): _arg(name, value, seen, 0) for key, value in kwargs.items()})
    if op == "placeholder" and (node.args or node.kwargs or target != name):
        raise InvalidRequestError(f"Custom loss input node {name!r} takes no arguments and is named as its input.")
    if op == "call_method" and not (node.args and isinstance(node.args[0], Ref)):
        raise InvalidRequestError(f"Custom loss node {name!r} calls method {target!r} on no earlier node.")
    if target == "getattr" and (len(node.args) != 2 or not isinstance(node.args[0], Ref)
                                or node.args[1] not in ATTRIBUTES):
        raise InvalidRequestError(f"Custom loss node {name!r} reads an attribute other than "
                                  f"{', '.join(sorted(ATTRIBUTES))} of a tensor.")
    return node


def _arg(node: str, value: Any, seen: set[str], depth: int) -> Any:
    """An encoded argument, decoded (SDK: ``_encode_arg``), references checked against the earlier nodes."""
    if depth > MAX_DEPTH:
        raise InvalidRequestError(f"Custom loss node {node!r} nests its arguments deeper than {MAX_DEPTH}.")
    if value is None or isinstance(value, (bool, int, float)):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise InvalidRequestError(f"Custom loss node {node!r} passes an integer past 64 bits.")
        return value
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise InvalidRequestError(f"Custom loss node {node!r} passes a string over {MAX_TEXT} characters.")
        return value
    if isinstance(value, list):
        return [_arg(node, item, seen, depth + 1) for item in _bounded(node, value)]
    if not (isinstance(value, dict) and len(value) == 1):
        raise InvalidRequestError(f"Custom loss node {node!r} passes an argument lilo cannot read: {str(value)[:80]}.")
    (kind, inner), = value.items()
    if kind == "ref":
        if inner not in seen:
            raise InvalidRequestError(f"Custom loss node {node!r} refers to {inner!r}, which is no earlier node.")
        return Ref(inner)
    if kind == "tuple" and isinstance(inner, list):
        return tuple(_arg(node, item, seen, depth + 1) for item in _bounded(node, inner))
    if kind == "dict" and isinstance(inner, dict):
        return {str(key): _arg(node, item, seen, depth + 1) for key, item in _bounded(node, inner).items()}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        return slice(*(_arg(node, item, seen, depth + 1) for item in inner))
    if kind == "ellipsis" and inner is True:
        return Ellipsis
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if kind == "dtype" and inner in DTYPES:
        return TorchName(inner)
    if kind == "device" and isinstance(inner, str):
        return Device()
    if kind == "layout" and inner == "strided":
        return None  # torch's default
    if kind == "memory_format" and inner in MEMORY_FORMATS:
        return TorchName(inner)
    raise InvalidRequestError(f"Custom loss node {node!r} passes a {kind!r} argument lilo does not take.")


def _bounded(node: str, items: Any) -> Any:
    if len(items) > MAX_ITEMS:
        raise InvalidRequestError(f"Custom loss node {node!r} passes a collection of over {MAX_ITEMS} items.")
    return items


def _check_output(node: Node) -> None:
    if len(node.args) != 1 or not isinstance(node.args[0], tuple) or len(node.args[0]) != 2:
        raise InvalidRequestError("A custom loss returns (loss, metrics).")
    loss, metrics = node.args[0]
    if not isinstance(loss, Ref) or not isinstance(metrics, dict):
        raise InvalidRequestError("A custom loss returns its loss as a tensor and its metrics as a dict.")
    for key, value in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(value, Ref):
            raise InvalidRequestError(f"Custom loss metric {key!r} must be a tensor named custom/<name>:sum or "
                                      "custom/<name>:mean.")


def check_loss_inputs(graph: LossGraph, shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> None:
    """Every datum (its loss inputs' shapes) has each input the loss reads, at its declared rank (``logprobs``
    has the shape of the datum's target tokens)."""
    for index, datum in enumerate(shapes):
        for name, rank in graph.inputs:
            key = "target_tokens" if name == "logprobs" else name
            if key not in datum:
                raise InvalidRequestError(f"Datum {index} has no loss_fn_inputs[{key!r}], which custom loss "
                                          f"{graph.name!r} takes.")
            if len(datum[key]) != rank:
                raise InvalidRequestError(f"Datum {index}: loss_fn_inputs[{key!r}] has rank {len(datum[key])}, but "
                                          f"custom loss {graph.name!r} declared {name} with rank {rank}.")


def run_loss_graph(graph: LossGraph, logprobs: Any, inputs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The loss and metrics of one datum: ``graph`` walked node by node over ``logprobs`` (with gradient) and the
    datum's ``inputs`` (tensors by name), calling only the allowed operations."""
    import torch  # here: checking a graph (the API front) needs no torch

    device = logprobs.device
    values: dict[str, Any] = {}
    bound = iter([logprobs, *(inputs[name] for name in graph.input_names)])

    def value(arg: Any) -> Any:
        if isinstance(arg, Ref):
            return values[arg.name]
        if isinstance(arg, TorchName):
            return getattr(torch, arg.name)
        if isinstance(arg, Device):
            return device
        if isinstance(arg, list):
            return [value(item) for item in arg]
        if isinstance(arg, tuple):
            return tuple(value(item) for item in arg)
        if isinstance(arg, dict):
            return {key: value(item) for key, item in arg.items()}
        if isinstance(arg, slice):
            return slice(value(arg.start), value(arg.stop), value(arg.step))
        return arg

    for node in graph.nodes:
        args, kwargs = [value(arg) for arg in node.args], {key: value(arg) for key, arg in node.kwargs.items()}
        if node.op == "placeholder":
            values[node.name] = next(bound)
        elif node.op == "output":
            loss, metrics = args[0]
            return loss, metrics
        elif node.op == "call_method":
            values[node.name] = _bounded_value(node, _call_method(node, args, kwargs))
        else:
            values[node.name] = _bounded_value(node, _function(node.target)(*args, **kwargs))
    raise InvalidRequestError(f"Custom loss {graph.name!r} has no output.")


def _call_method(node: Node, args: list, kwargs: dict) -> Any:
    import torch

    tensor, *rest = args
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"Custom loss node {node.name!r} calls {node.target!r} on a "
                                  f"{type(tensor).__name__}, not a tensor.")
    if node.target in _NEW_TENSORS:
        size = rest[0] if rest and isinstance(rest[0], (tuple, list, torch.Size)) else rest[:1]
        if math.prod(int(n) for n in size) > MAX_ELEMENTS:
            raise InvalidRequestError(f"Custom loss node {node.name!r} makes a tensor of over {MAX_ELEMENTS} "
                                      "elements.")
    return getattr(tensor, node.target)(*rest, **kwargs)


def _bounded_value(node: Node, value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.numel() > MAX_ELEMENTS:
        raise InvalidRequestError(f"Custom loss node {node.name!r} makes a tensor of {value.numel()} elements, over "
                                  f"the {MAX_ELEMENTS} a loss's value may hold.")
    return value


def _function(target: str) -> Any:
    import operator

    import torch

    if target == "getattr":
        return _attribute
    module, _, name = target.rpartition(".")
    namespace = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch._C._nn": torch._C._nn,
                 "operator": operator, "math": math}[module]
    return getattr(namespace, name)


def _attribute(tensor: Any, name: str) -> Any:
    import torch

    if not isinstance(tensor, torch.Tensor) or name not in ATTRIBUTES:
        raise InvalidRequestError(f"A custom loss may read {', '.join(sorted(ATTRIBUTES))} of a tensor only.")
    return getattr(tensor, name)
