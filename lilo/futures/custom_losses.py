"""Losses clients uploaded to run on the server (``create_custom_loss``), in the futures database: recorded once
per ``(session, custom_loss_seq_id)``, read back by id for the caller's tenant. The graph is kept as the JSON it
came in and checked again whenever it is read (``lilo.backend.training.loss_graph``); it is never unpickled."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import Engine, select

from lilo.errors import ConflictError, NotFoundError
from lilo.futures.database import insert
from lilo.futures.schema import custom_losses
from lilo.tenants import may_see


def custom_loss_id(session_id: str, custom_loss_seq_id: int) -> str:
    # A function of what the client sends: a retried create_custom_loss names the same loss.
    return f"{session_id}:loss:{custom_loss_seq_id}"


class CustomLossRecords:
    """Called on the futures DB's one writer thread."""

    def __init__(self, engine: Engine, clock) -> None:
        self._engine = engine
        self._clock = clock

    def add(self, loss_id: str, session_id: str, tenant: str | None, body: dict[str, Any]) -> None:
        """Record the loss; a retry is a no-op, another loss under the same id a conflict."""
        encoded = orjson.dumps(body, option=orjson.OPT_SORT_KEYS).decode()
        with self._engine.begin() as connection:
            connection.execute(insert(connection, custom_losses).values(
                loss_id=loss_id, session_id=session_id, tenant=tenant, body=encoded,
                created_at=self._clock()).on_conflict_do_nothing())
            known = connection.execute(select(custom_losses.c.body).where(custom_losses.c.loss_id == loss_id)).scalar()
        if known != encoded:
            raise ConflictError(f"Custom loss {loss_id!r} was created with another graph; create each loss with the "
                                "session's next custom_loss_seq_id.")

    def get(self, loss_id: str, tenant: str | None) -> dict[str, Any]:
        """The loss as it was sent; 404 for an unknown one, or another tenant's."""
        with self._engine.connect() as connection:
            row = connection.execute(select(custom_losses.c.body, custom_losses.c.tenant)
                                     .where(custom_losses.c.loss_id == loss_id)).first()
        if row is None or not may_see(tenant, row.tenant):
            raise NotFoundError(f"Unknown custom loss {loss_id!r}; create it with ServiceClient.create_custom_loss in "
                                "this session first.")
        return orjson.loads(row.body)
