"""Checkpoints by their tinker path, as the SDK's RestClient and the ``tinker checkpoint`` CLI use them: TTLs,
publishing, weights info, signed download links and the downloads themselves, and copies.

Who may do what (``lilo.futures.checkpoint_records.access_refusal``): a tenant reads its own checkpoints and
published ones of other tenants by their path; only its own tenant changes or deletes one. Another tenant's private
checkpoint answers exactly as one of no run (404). A checkpoint past its TTL answers 410, saying so. The files are
read through the trainer that keeps the run's files (``cluster.placement.ask_file_keeper``), in their storage;
downloads stream from there a chunk at a time through this replica, or, where the storage signs URLs itself (S3),
straight from the storage.
"""

from __future__ import annotations

import datetime
import hashlib
import time
import uuid
from typing import Any, AsyncIterator
from urllib.parse import quote, urlencode

from lilo.backend.checkpoints.index import EXTERNAL_WEIGHTS, checkpoint_path, relative_directory
from lilo.backend.checkpoints.paths import TINKER_SCHEME, parse_tinker_path
from lilo.backend.types import LoraSpec
from lilo.errors import ForbiddenError, InvalidRequestError, NotFoundError
from lilo.futures.checkpoint_records import CheckpointRecord, expiry_for
from lilo.signed_urls import LINK_LIFETIME_S, DownloadGrant, refusal, signature
from lilo.storage import Storage
from serve.tinker.actors import Actors
from serve.tinker.requests import CopyWeightsRequest, TinkerPathRequest, TtlRequest

DOWNLOAD_CHUNK_BYTES = 4 << 20
DOWNLOAD_ROUTE = "/api/v1/downloads"
COPY_PREFIX = "copy-"
COPY_REASON = ("it holds a copy of a checkpoint (copy_weights) and cannot be trained; create a training client from "
               "its checkpoint (create_training_client_from_state) to train on.")


def download_path(path: str, file: str) -> str:
    run, kind, name = parse_tinker_path(path)
    return f"{DOWNLOAD_ROUTE}/{quote(run, safe='')}/{kind}/{name}/{quote(file, safe='')}"


def copy_run_id(tenant: str, request: CopyWeightsRequest, idempotency_key: str | None) -> str:
    """The training run a copy goes to: the session's model ``model_seq_id`` when a session is named, else one named
    after the request's idempotency key (the SDK keeps one key over its retries, so a retry finds the same copy)."""
    if request.session_id is not None and request.model_seq_id is not None:
        return f"{request.session_id}:train:{request.model_seq_id}"
    key = idempotency_key or uuid.uuid4().hex
    return COPY_PREFIX + hashlib.sha256(f"{tenant}\n{key}".encode()).hexdigest()[:16]


class Checkpoints:
    """Checkpoints by their tinker path; ``url_secret`` signs and checks the download links."""

    def __init__(self, actors: Actors, url_secret: bytes, storage: Storage | None = None) -> None:
        self._actors = actors
        self._futures = actors.futures
        self._url_secret = url_secret
        self._storage = storage  # the checkpoints' storage (--storage), whose own signed URLs links may be

    async def _files(self, path: str, tenant: str,
                     write: bool = False) -> tuple[dict[str, Any], CheckpointRecord | None, dict[str, int]]:
        """(its run, its record, ``file -> size``) of a checkpoint ``tenant`` may use (``write``: as its tenant), or
        the 404 of an unknown one (410 when it expired)."""
        run, record = await self._futures.readable_checkpoint.remote(path, tenant, write)
        files = await self._actors.ask_file_keeper(run["trainer"], "checkpoint_files", path)
        return run, record, files

    async def set_ttl(self, run_id: str, checkpoint_id: str, request: TtlRequest, tenant: str) -> None:
        path = checkpoint_path(run_id, checkpoint_id)
        expires_at = expiry_for(request.ttl_seconds, time.time())
        run, _, _ = await self._files(path, tenant, write=True)
        await self._futures.set_checkpoint_expiry.remote(path, run["tenant"], expires_at)

    async def set_public(self, run_id: str, checkpoint_id: str, public: bool, tenant: str) -> None:
        path = checkpoint_path(run_id, checkpoint_id)
        run, _, _ = await self._files(path, tenant, write=True)
        await self._futures.set_checkpoint_public.remote(path, run["tenant"], public)

    async def weights_info(self, request: TinkerPathRequest, tenant: str) -> dict[str, Any]:
        """The SDK's ``WeightsInfoResponse``: what a checkpoint was trained on, and its LoRA shape (every checkpoint
        of a run has the run's)."""
        run, _, _ = await self._files(request.tinker_path, tenant)
        spec = LoraSpec.from_config(run["lora_config"] or {})
        return {"base_model": run["base_model"], "is_lora": True, "lora_rank": spec.rank,
                "train_unembed": spec.train_unembed, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn}

    async def external_urls(self, run_id: str, checkpoint_id: str, tenant: str, base_url: str) -> dict[str, Any]:
        """The SDK's ``ExternalWeightsUrlsResponse``: one signed link per file of an external weights checkpoint, all
        valid for ``LINK_LIFETIME_S``: the storage's own where it signs them (the bytes then never pass through
        lilo), else served by this service (``base_url``: the one the request came to)."""
        path = checkpoint_path(run_id, checkpoint_id)
        if parse_tinker_path(path)[1] != EXTERNAL_WEIGHTS:
            raise InvalidRequestError(f"{path!r} is not an external weights checkpoint; links are given for paths "
                                      "save_weights_external returned (tinker://<run>/external_weights/<name>).")
        _, _, files = await self._files(path, tenant)
        expires_at = int(time.time()) + LINK_LIFETIME_S
        urls = {}
        for file in files:
            stored = self._storage.signed_url(f"{relative_directory(path)}/{file}", LINK_LIFETIME_S) \
                if self._storage is not None else None
            if stored is not None:
                urls[file] = stored
                continue
            grant = DownloadGrant(tenant, path, file, expires_at)
            query = urlencode({"tenant": tenant, "expires": expires_at,
                               "signature": signature(self._url_secret, grant)})
            urls[file] = f"{base_url.rstrip('/')}{download_path(path, file)}?{query}"
        return {"urls": urls,
                "expires": datetime.datetime.fromtimestamp(expires_at, datetime.timezone.utc).isoformat()}

    async def open_download(self, run_id: str, name: str, file: str, tenant: str, expires: int,
                            offered: str) -> tuple[int, AsyncIterator[bytes]]:
        """(size, chunks) of the file a signed link (``download_path``) names, once its signature and expiry are
        checked (403), and the tenant it was signed for may still read the checkpoint (404: unpublished, deleted or
        not theirs; 410: past its TTL)."""
        grant = DownloadGrant(tenant, f"{TINKER_SCHEME}{run_id}/{EXTERNAL_WEIGHTS}/{name}", file, expires)
        why = refusal(self._url_secret, grant, offered, time.time())
        if why is not None:
            raise ForbiddenError(why)
        run, _, files = await self._files(grant.tinker_path, grant.tenant)
        if grant.file not in files:
            raise NotFoundError(f"Checkpoint {grant.tinker_path!r} has no file {grant.file!r} any more (saved again "
                                "since?); ask get_external_weights_urls for new links.")
        size = files[grant.file]

        async def chunks() -> AsyncIterator[bytes]:
            for offset in range(0, size, DOWNLOAD_CHUNK_BYTES):
                yield await self._actors.ask_file_keeper(run["trainer"], "read_checkpoint_file", grant.tinker_path,
                                                         grant.file, offset, DOWNLOAD_CHUNK_BYTES)

        return size, chunks()

    async def copy_weights(self, request: CopyWeightsRequest, tenant: str, idempotency_key: str | None,
                           access_token_header: str | None) -> dict[str, str]:
        """A copy of a checkpoint the caller may read (its own, or a public one) in a new training run of the
        caller's that cannot be trained (unloaded from the start, with a reason saying so), on the same trainer's
        disk as hard links. Returns the SDK's ``CopyWeightsResponse``."""
        if request.weights_access_token or access_token_header:
            raise InvalidRequestError("lilo has no weights access tokens; a checkpoint another tenant published is "
                                      "readable by its tinker path as it is. Leave weights_access_token out.")
        if (request.session_id is None) != (request.model_seq_id is None):
            raise InvalidRequestError("copy_weights takes session_id with model_seq_id, or neither (then the copy "
                                      "goes to a new training run of its own).")
        source = request.source_path
        _, kind, name = parse_tinker_path(source)
        expires_at = expiry_for(request.ttl_seconds, time.time())
        if request.session_id is not None:
            await self._futures.check_session.remote(request.session_id, tenant)
        run, _, _ = await self._files(source, tenant)
        copy_run = copy_run_id(tenant, request, idempotency_key)
        destination = f"{TINKER_SCHEME}{copy_run}/{kind}/{name}"
        copy_tenant, _ = await self._futures.tenant_and_trainer_of.remote(copy_run)
        if copy_tenant is None:
            await self._futures.add_model.remote(copy_run, run["base_model"], run["lora_config"], tenant=tenant,
                                                 session_id=request.session_id, trainer=run["trainer"])
            await self._futures.mark_unloaded.remote(copy_run, COPY_REASON)
        copied = await self._futures.training_run.remote(copy_run, tenant)  # 404 if the id is another tenant's run
        if copied["unloaded_reason"] != COPY_REASON:  # a retry finds its own copy run; anything else is taken
            raise InvalidRequestError(f"Training run {copy_run!r} exists already and is not a copy; pass the "
                                      "session's next model_seq_id, or a destination_project_id instead of a session.")
        await self._actors.ask_file_keeper(copied["trainer"], "copy_checkpoint", source, destination)
        await self._futures.record_checkpoint_save.remote(destination, tenant, expires_at)
        return {"tinker_path": destination}
