"""Checkpoints by their tinker path, as the SDK's RestClient and the ``tinker checkpoint`` CLI use them: TTLs,
publishing, weights info, signed download links and the downloads themselves, and copies.

Who may do what (``lilo.futures.checkpoint_records.access_refusal``): a tenant reads its own checkpoints and
published ones of other tenants by their path; only its own tenant changes or deletes one. Another tenant's private
checkpoint answers exactly as one of no run (404). A checkpoint past its TTL answers 410, saying so. The files are
the trainer's that keeps the run's files (``cluster.placement.ask_file_keeper``); downloads stream from there a
chunk at a time through this replica.
"""

from __future__ import annotations

import datetime
import hashlib
import time
import uuid
from typing import Any, AsyncIterator, Sequence
from urllib.parse import quote, urlencode

from ray.actor import ActorHandle

from cluster.placement import ask_file_keeper
from lilo.backend.checkpoint_index import EXTERNAL_WEIGHTS, checkpoint_path
from lilo.backend.checkpoint_paths import TINKER_SCHEME, parse_tinker_path
from lilo.backend.types import LoraSpec
from lilo.errors import ForbiddenError, InvalidRequestError, NotFoundError
from lilo.futures.checkpoint_records import CheckpointRecord, expiry_for
from lilo.signed_urls import LINK_LIFETIME_S, DownloadGrant, refusal, signature

DOWNLOAD_CHUNK_BYTES = 4 << 20
DOWNLOAD_ROUTE = "/api/v1/downloads"
COPY_PREFIX = "copy-"
COPY_REASON = ("it holds a copy of a checkpoint (copy_weights) and cannot be trained; create a training client from "
               "its checkpoint (create_training_client_from_state) to train on.")


async def checkpoint_files(futures: ActorHandle, trainers: Sequence[str], path: str, tenant: str,
                           write: bool = False) -> tuple[dict[str, Any], CheckpointRecord | None, dict[str, int]]:
    """(its run, its record, ``file -> size``) of a checkpoint ``tenant`` may use (``write``: as its tenant), or the
    404 of an unknown one (410 when it expired)."""
    run, record = await futures.readable_checkpoint.remote(path, tenant, write)
    files = await ask_file_keeper(run["trainer"], trainers, "checkpoint_files", path)
    return run, record, files


async def set_ttl(futures: ActorHandle, trainers: Sequence[str], run_id: str, checkpoint_id: str,
                  ttl_seconds: int | None, tenant: str) -> None:
    path = checkpoint_path(run_id, checkpoint_id)
    expires_at = expiry_for(ttl_seconds, time.time())
    run, _, _ = await checkpoint_files(futures, trainers, path, tenant, write=True)
    await futures.set_checkpoint_expiry.remote(path, run["tenant"], expires_at)


async def set_public(futures: ActorHandle, trainers: Sequence[str], run_id: str, checkpoint_id: str,
                     public: bool, tenant: str) -> None:
    path = checkpoint_path(run_id, checkpoint_id)
    run, _, _ = await checkpoint_files(futures, trainers, path, tenant, write=True)
    await futures.set_checkpoint_public.remote(path, run["tenant"], public)


async def weights_info(futures: ActorHandle, trainers: Sequence[str], path: str, tenant: str) -> dict[str, Any]:
    """The SDK's ``WeightsInfoResponse``: what a checkpoint was trained on, and its LoRA shape (every checkpoint of
    a run has the run's)."""
    run, _, _ = await checkpoint_files(futures, trainers, path, tenant)
    spec = LoraSpec.from_config(run["lora_config"] or {})
    return {"base_model": run["base_model"], "is_lora": True, "lora_rank": spec.rank,
            "train_unembed": spec.train_unembed, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn}


async def external_urls(futures: ActorHandle, trainers: Sequence[str], run_id: str, checkpoint_id: str,
                        tenant: str, base_url: str, secret: bytes) -> dict[str, Any]:
    """The SDK's ``ExternalWeightsUrlsResponse``: one signed link per file of an external weights checkpoint,
    served by this service (``base_url``: the one the request came to), all valid for ``LINK_LIFETIME_S``."""
    path = checkpoint_path(run_id, checkpoint_id)
    if parse_tinker_path(path)[1] != EXTERNAL_WEIGHTS:
        raise InvalidRequestError(f"{path!r} is not an external weights checkpoint; links are given for paths "
                                  "save_weights_external returned (tinker://<run>/external_weights/<name>).")
    _, _, files = await checkpoint_files(futures, trainers, path, tenant)
    expires_at = int(time.time()) + LINK_LIFETIME_S
    urls = {}
    for file in files:
        grant = DownloadGrant(tenant, path, file, expires_at)
        query = urlencode({"tenant": tenant, "expires": expires_at, "signature": signature(secret, grant)})
        urls[file] = f"{base_url.rstrip('/')}{download_path(path, file)}?{query}"
    return {"urls": urls, "expires": datetime.datetime.fromtimestamp(expires_at, datetime.timezone.utc).isoformat()}


def download_path(path: str, file: str) -> str:
    run, kind, name = parse_tinker_path(path)
    return f"{DOWNLOAD_ROUTE}/{quote(run, safe='')}/{kind}/{name}/{quote(file, safe='')}"


async def open_download(futures: ActorHandle, trainers: Sequence[str], grant: DownloadGrant, offered: str,
                        secret: bytes) -> tuple[int, AsyncIterator[bytes]]:
    """(size, chunks) of the file a signed link names, once its signature and expiry are checked (403), and the
    tenant it was signed for may still read the checkpoint (404: unpublished, deleted or not theirs; 410: past its
    TTL)."""
    why = refusal(secret, grant, offered, time.time())
    if why is not None:
        raise ForbiddenError(why)
    run, _, files = await checkpoint_files(futures, trainers, grant.tinker_path, grant.tenant)
    if grant.file not in files:
        raise NotFoundError(f"Checkpoint {grant.tinker_path!r} has no file {grant.file!r} any more (saved again "
                            "since?); ask get_external_weights_urls for new links.")
    size = files[grant.file]

    async def chunks() -> AsyncIterator[bytes]:
        for offset in range(0, size, DOWNLOAD_CHUNK_BYTES):
            yield await ask_file_keeper(run["trainer"], trainers, "read_checkpoint_file", grant.tinker_path,
                                        grant.file, offset, DOWNLOAD_CHUNK_BYTES)

    return size, chunks()


def copy_run_id(tenant: str, body: dict[str, Any], idempotency_key: str | None) -> str:
    """The training run a copy goes to: the session's model ``model_seq_id`` when a session is named, else one named
    after the request's idempotency key (the SDK keeps one key over its retries, so a retry finds the same copy)."""
    if body.get("session_id") is not None and body.get("model_seq_id") is not None:
        return f"{body['session_id']}:train:{int(body['model_seq_id'])}"
    key = idempotency_key or uuid.uuid4().hex
    return COPY_PREFIX + hashlib.sha256(f"{tenant}\n{key}".encode()).hexdigest()[:16]


async def copy_weights(futures: ActorHandle, trainers: Sequence[str], body: dict[str, Any], tenant: str,
                       idempotency_key: str | None) -> dict[str, str]:
    """A copy of a checkpoint the caller may read (its own, or a public one) in a new training run of the caller's
    that cannot be trained (unloaded from the start, with a reason saying so), on the same trainer's disk as hard
    links. Returns the SDK's ``CopyWeightsResponse``."""
    source = str(body["source_path"])
    _, kind, name = parse_tinker_path(source)
    expires_at = expiry_for(body.get("ttl_seconds"), time.time())
    if body.get("session_id") is not None:
        await futures.check_session.remote(body["session_id"], tenant)
    run, _, _ = await checkpoint_files(futures, trainers, source, tenant)
    copy_run = copy_run_id(tenant, body, idempotency_key)
    destination = f"{TINKER_SCHEME}{copy_run}/{kind}/{name}"
    copy_tenant, _ = await futures.tenant_and_trainer_of.remote(copy_run)
    if copy_tenant is None:
        await futures.add_model.remote(copy_run, run["base_model"], run["lora_config"], tenant=tenant,
                                       session_id=body.get("session_id"), trainer=run["trainer"])
        await futures.mark_unloaded.remote(copy_run, COPY_REASON)
    copied = await futures.training_run.remote(copy_run, tenant)  # 404 if the id is another tenant's run
    if copied["unloaded_reason"] != COPY_REASON:  # a retry finds its own copy run; anything else is taken
        raise InvalidRequestError(f"Training run {copy_run!r} exists already and is not a copy; pass the session's "
                                  "next model_seq_id, or a destination_project_id instead of a session.")
    await ask_file_keeper(copied["trainer"], trainers, "copy_checkpoint", source, destination)
    await futures.record_checkpoint_save.remote(destination, tenant, expires_at)
    return {"tinker_path": destination}
