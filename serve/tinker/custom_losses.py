"""Custom losses the server runs (the SDK's ``create_custom_loss`` with ``custom_loss_server_side``): stored per
session, refused when they are not a loss of allowed torch operations, and resolved into the training request that
names one (``forward_backward`` with ``loss_fn`` ``custom`` and ``loss_fn_config`` ``{"loss_id": ...}``), so the
trainer runs it in its pass beside every other loss (lilo.backend.training.loss_graph)."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from lilo.backend.training.loss_graph import LossGraph, parse_loss_graph
from lilo.backend.training.loss_inputs import CUSTOM
from lilo.backend.types import TrainInput
from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError
from lilo.futures.custom_losses import custom_loss_id
from lilo.futures.store import Completion, Submission
from serve.tinker.actors import Actors
from serve.tinker.requests import CreateCustomLossRequest

MAX_CACHED = 10_000  # losses remembered per ingress replica (they never change; past it, all are forgotten)


class CustomLosses:
    def __init__(self, actors: Actors) -> None:
        self._futures = actors.futures
        self._graphs: dict[tuple[str, str], LossGraph] = {}  # (loss id, tenant) -> its checked graph

    async def create(self, request: CreateCustomLossRequest, tenant: str) -> dict[str, str]:
        """Check and store the loss; its future (answered at once) gives its ``loss_id``."""
        await self._futures.check_session.remote(request.session_id, tenant)
        body = {"name": request.name, "inputs": request.inputs, "graph": request.graph}
        parse_loss_graph(**body)  # 422, naming the node, before anything is recorded
        loss_id = custom_loss_id(request.session_id, request.custom_loss_seq_id)
        await self._futures.add_custom_loss.remote(loss_id, request.session_id, tenant, body)
        outcome = await self._futures.submit_once.remote(Submission(
            f"{request.session_id}:losses", Kind.CREATE_CUSTOM_LOSS, body, seq_id=request.custom_loss_seq_id,
            tenant=tenant).prepared())
        # Written again for a retry too: it changes only a future still pending (one whose first answer was lost).
        await self._futures.complete.remote([Completion.success(
            outcome.request_id, orjson.dumps({"loss_id": loss_id, "type": Kind.CREATE_CUSTOM_LOSS}),
            kind=Kind.CREATE_CUSTOM_LOSS)])
        return {"request_id": str(outcome.request_id)}

    async def resolved(self, train: TrainInput, tenant: str) -> TrainInput:
        """``train`` with the stored loss its ``loss_id`` names, for a custom loss; else as it is."""
        if train.loss_fn != CUSTOM:
            return train
        loss_id = train.loss_config.get("loss_id")
        if not isinstance(loss_id, str):
            raise InvalidRequestError("loss_fn 'custom' needs loss_fn_config {'loss_id': ...}, the id "
                                      "create_custom_loss returned.")
        key = (loss_id, tenant)
        graph = self._graphs.get(key)
        if graph is None:
            stored: dict[str, Any] = await self._futures.custom_loss.remote(loss_id, tenant)
            graph = parse_loss_graph(**stored)
            if len(self._graphs) >= MAX_CACHED:
                self._graphs.clear()
            self._graphs[key] = graph
        return dataclasses.replace(train, custom_loss=graph)
