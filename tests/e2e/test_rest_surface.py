"""The RestClient and ``tinker`` CLI surface, through the real SDK (0.38.0) and the real CLI against the session
cluster: downloads through signed links (a PEFT directory that peft loads, with the service's logits), checkpoint
TTLs and their expiry, publishing across tenants, weights info, copies, sessions, and the calls a self-hosted
service answers with a 404 that says why."""

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import numpy as np
import pytest
import ray
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.recovery import RECOVERY_ACTOR_NAME
from conftest import TENANT_KEYS, TINY_DIRECTORY
from helpers import API_KEY, cli_json, tinker_cli
from lilo.backend.checkpoints.paths import local_directory
from lilo.signed_urls import SECRET_FILE, DownloadGrant, read_secret, signature

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
ADAM = types.AdamParams(learning_rate=2e-2)


def datum(seed: int = 5) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(3, 1000, 12).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})


def trained(service, base_model: str = TINY, rank: int = 4):
    training = service.create_lora_training_client(base_model=base_model, rank=rank).result(timeout=TIMEOUT_S)
    for _ in range(2):
        training.forward_backward([datum()], "cross_entropy").result(timeout=TIMEOUT_S)
        training.optim_step(ADAM).result(timeout=TIMEOUT_S)
    return training


def rest_client(local_cluster, tenant: str | None = None) -> tinker.RestClient:
    return tinker.RestClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS[tenant] if tenant else API_KEY)


@pytest.fixture(scope="module")
def alpha_service(local_cluster):
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS["alpha"]) as client:
        yield client


def fetch(url: str) -> tuple[int, bytes]:
    """GET a download link as the CLI does (urllib, no API key): (status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def link(local_cluster, grant: DownloadGrant, secret: bytes, file_in_url: str | None = None) -> str:
    """A download link for ``grant`` signed with ``secret``, as the service makes them (``file_in_url``: another
    file name in its path than the one signed)."""
    run, kind, name = grant.tinker_path[len("tinker://"):].split("/")
    query = f"tenant={grant.tenant}&expires={grant.expires_at}&signature={signature(secret, grant)}"
    file = quote(file_in_url if file_in_url is not None else grant.file, safe="")
    return f"{local_cluster.api_url}/api/v1/downloads/{quote(run, safe='')}/{kind}/{name}/{file}?{query}"


def test_cli_download_of_a_saved_state_is_a_peft_directory_with_the_services_logits(service, local_cluster, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    training = trained(service, base_model=str(TINY_DIRECTORY))
    saved = training.save_state("for-download").result(timeout=TIMEOUT_S).path
    downloaded = cli_json(local_cluster, "checkpoint", "download", saved, "--output", str(tmp_path), "--force")
    directory = Path(downloaded["destination"])
    assert directory == tmp_path / saved.replace("tinker://", "").replace("/", "_")
    assert sorted(path.name for path in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    base = AutoModelForCausalLM.from_pretrained(TINY_DIRECTORY, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(directory)).eval()
    tokens = datum(9).model_input.to_ints()
    with torch.no_grad():
        logits = adapted(input_ids=torch.as_tensor([tokens])).logits[0]
    theirs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0]
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    ours = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=TIMEOUT_S)
    assert ours[0] is None
    np.testing.assert_allclose(ours[1:], theirs.numpy(), atol=1e-4)
    with torch.no_grad(), adapted.disable_adapter():
        bare = torch.log_softmax(adapted(input_ids=torch.as_tensor([tokens])).logits[0][:-1], dim=-1)
    assert not np.allclose(ours[1:], bare.gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0].numpy(), atol=1e-3)


def test_the_cli_lists_runs_and_checkpoints_shows_one_sets_its_ttl_and_deletes_it(service, local_cluster):
    training = trained(service)
    weights = training.save_state("cli-weights").result(timeout=TIMEOUT_S).path
    sampler = training.save_weights_for_sampler("cli-sampler").result(timeout=TIMEOUT_S).path
    assert training.model_id in {run["training_run_id"] for run in cli_json(local_cluster, "run", "list")["runs"]}
    listed = cli_json(local_cluster, "checkpoint", "list", "--run-id", training.model_id)["checkpoints"]
    assert {(c["tinker_path"], c["checkpoint_type"], c["expires_at"]) for c in listed} == {
        (weights, "training", None), (sampler, "sampler", None)}

    before = time.time()
    assert tinker_cli(local_cluster, "checkpoint", "set-ttl", weights, "--ttl", "7200").returncode == 0
    info = cli_json(local_cluster, "checkpoint", "info", weights)
    expires = info["expires_at"]
    expires_s = expires.timestamp() if hasattr(expires, "timestamp") else \
        time.mktime(time.strptime(expires[:19], "%Y-%m-%d %H:%M:%S")) - time.timezone
    assert before + 7200 - 5 <= expires_s <= time.time() + 7200 + 5 and info["lora_rank"] == 4

    too_short = tinker_cli(local_cluster, "checkpoint", "set-ttl", weights, "--ttl", "60")
    assert too_short.returncode != 0 and "out of range" in too_short.stderr and "3600" in too_short.stderr
    assert tinker_cli(local_cluster, "checkpoint", "set-ttl", weights, "--remove").returncode == 0
    assert cli_json(local_cluster, "checkpoint", "info", weights)["expires_at"] is None

    deleted = cli_json(local_cluster, "checkpoint", "delete", weights, "--yes")
    assert deleted == {"deleted_count": 1, "failed": []}
    listed = cli_json(local_cluster, "checkpoint", "list", "--run-id", training.model_id)["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [sampler]


def test_download_links_are_signed_expire_and_serve_only_what_they_name(alpha_service, local_cluster):
    training = trained(alpha_service)
    path = training.save_weights_external("export").result(timeout=TIMEOUT_S).path
    assert path == f"tinker://{training.model_id}/external_weights/export"
    alpha, beta = rest_client(local_cluster, "alpha"), rest_client(local_cluster, "beta")
    before = time.time()
    answer = alpha.get_external_weights_urls(path).result(timeout=TIMEOUT_S)
    assert sorted(answer.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert before + 3600 - 5 <= answer.expires.timestamp() <= time.time() + 3600 + 5
    on_disk = local_directory(local_cluster.home / "checkpoints", path)
    for file, url in answer.urls.items():
        assert urlsplit(url).netloc == urlsplit(local_cluster.api_url).netloc  # served by lilo itself
        assert fetch(url) == (200, (on_disk / file).read_bytes())

    url = answer.urls["adapter_config.json"]
    query = parse_qs(urlsplit(url).query)
    forged = url.replace(query["signature"][0], "0" * 64)
    other_file = url.replace("adapter_config.json", "adapter_model.safetensors")
    for refused in (forged, other_file, url.replace("tenant=alpha", "tenant=beta"),
                    url.replace(f"expires={query['expires'][0]}", f"expires={int(query['expires'][0]) + 3600}")):
        status, body = fetch(refused)
        assert status == 403 and "not one lilo signed" in json.loads(body)["detail"], refused

    secret = read_secret(local_cluster.home / SECRET_FILE)
    expired = DownloadGrant("alpha", path, "adapter_config.json", int(time.time()) - 1)
    status, body = fetch(link(local_cluster, expired, secret))
    assert status == 403 and "expired" in json.loads(body)["detail"]
    # Even links signed with the real secret reach nothing outside the checkpoint's own files.
    (local_cluster.home / "checkpoints" / "outside.txt").write_text("content outside the checkpoint")
    for file in ("../../../url-signing-secret", "../../outside.txt", "..", "meta.json", "a/../../outside.txt"):
        status, body = fetch(link(local_cluster, DownloadGrant("alpha", path, file, int(time.time()) + 60), secret))
        assert status in (404, 422) and b"content outside" not in body and secret.hex().encode() not in body, file
    for escaping in ("tinker://../external_weights/export", f"tinker://{training.model_id}/external_weights/.."):
        grant = DownloadGrant("alpha", escaping, "adapter_config.json", int(time.time()) + 60)
        status, _ = fetch(link(local_cluster, grant, secret))
        assert status in (404, 422), escaping

    # Another tenant gets no links to a private checkpoint, and a link signed for it serves nothing.
    with pytest.raises(tinker.NotFoundError, match="Unknown model_id"):
        beta.get_external_weights_urls(path).result(timeout=TIMEOUT_S)
    for_beta = DownloadGrant("beta", path, "adapter_config.json", int(time.time()) + 60)
    assert fetch(link(local_cluster, for_beta, secret))[0] == 404
    alpha.publish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT_S)
    beta_url = beta.get_external_weights_urls(path).result(timeout=TIMEOUT_S).urls["adapter_config.json"]
    assert fetch(beta_url) == (200, (on_disk / "adapter_config.json").read_bytes())
    alpha.unpublish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT_S)
    assert fetch(beta_url)[0] == 404  # unpublishing ends the links given out for it
    with pytest.raises(ValueError, match="external weights"):  # the SDK itself refuses other kinds
        alpha.get_external_weights_urls(path.replace("external_weights", "weights"))


def test_a_checkpoint_past_its_ttl_is_refused_saying_so_and_swept_from_disk(service, local_cluster, ray_driver):
    training = trained(service)
    rest = rest_client(local_cluster)
    path = training.save_state("short-lived", ttl_seconds=3600).result(timeout=TIMEOUT_S).path
    [listed] = [c for c in rest.list_checkpoints(training.model_id).result(timeout=TIMEOUT_S).checkpoints
                if c.tinker_path == path]
    assert listed.expires_at is not None and listed.expires_at.timestamp() > time.time() + 3500
    with pytest.raises(tinker.UnprocessableEntityError, match="ttl_seconds 60 is out of range"):
        training.save_state("too-short", ttl_seconds=60).result(timeout=TIMEOUT_S)

    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    ray.get(futures.set_checkpoint_expiry.remote(path, "local", time.time() - 1))  # as if an hour had passed
    run_paths = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result(timeout=TIMEOUT_S).checkpoints}
    user_paths = {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result(timeout=TIMEOUT_S).checkpoints}
    assert path not in run_paths and path not in user_paths
    refusals = (lambda: rest.get_weights_info_by_tinker_path(path),
                lambda: rest.set_checkpoint_ttl_from_tinker_path(path, None),
                lambda: rest.publish_checkpoint_from_tinker_path(path),
                lambda: rest.delete_checkpoint_from_tinker_path(path),
                lambda: service.create_training_client_from_state(path))
    for refused in refusals:
        with pytest.raises(tinker.APIStatusError, match="expired at .* \\(its TTL\\)") as raised:
            refused().result(timeout=TIMEOUT_S)
        assert raised.value.status_code == 410

    on_disk = local_directory(local_cluster.home / "checkpoints", path)
    assert on_disk.is_dir()
    recovery = ray.get_actor(RECOVERY_ACTOR_NAME, namespace=NAMESPACE)
    assert path in ray.get(recovery.sweep_expired_checkpoints.remote())
    assert not on_disk.exists()
    with pytest.raises(tinker.APIStatusError, match="expired at"):  # still says why, once deleted
        rest.get_weights_info_by_tinker_path(path).result(timeout=TIMEOUT_S)
    # Saved again under the name (without a TTL), it lives again.
    assert training.save_state("short-lived").result(timeout=TIMEOUT_S).path == path
    assert rest.get_weights_info_by_tinker_path(path).result(timeout=TIMEOUT_S).lora_rank == 4


def test_a_published_checkpoint_is_readable_by_path_by_other_tenants_never_listed_or_changed_by_them(
        alpha_service, local_cluster):
    training = trained(alpha_service)
    weights = training.save_state("to-share").result(timeout=TIMEOUT_S).path
    sampler = training.save_weights_for_sampler("to-share").result(timeout=TIMEOUT_S).path
    alpha, beta = rest_client(local_cluster, "alpha"), rest_client(local_cluster, "beta")
    with pytest.raises(tinker.NotFoundError):
        beta.get_weights_info_by_tinker_path(weights).result(timeout=TIMEOUT_S)
    for path in (weights, sampler):
        alpha.publish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT_S)
    assert all(c.public for c in alpha.list_checkpoints(training.model_id).result(timeout=TIMEOUT_S).checkpoints)

    assert beta.get_weights_info_by_tinker_path(weights).result(timeout=TIMEOUT_S).base_model == TINY
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS["beta"]) as beta_service:
        loaded = beta_service.create_training_client_from_state(weights).result(timeout=TIMEOUT_S)
        expected = training.forward([datum()], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"]
        assert loaded.forward([datum()], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"] == \
            pytest.approx(expected, rel=1e-6)
        sampling = beta_service.create_sampling_client(model_path=sampler)
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        assert len(sampling.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result(
            timeout=TIMEOUT_S).sequences[0].tokens) == 3
        copied = beta.copy_weights(weights, "beta-archive").result(timeout=TIMEOUT_S)
    assert beta.get_weights_info_by_tinker_path(copied).result(timeout=TIMEOUT_S).lora_rank == 4

    assert training.model_id not in {r.training_run_id for r in beta.list_training_runs(limit=100).result(
        timeout=TIMEOUT_S).training_runs}
    assert not {weights, sampler} & {c.tinker_path for c in beta.list_user_checkpoints(limit=1000).result(
        timeout=TIMEOUT_S).checkpoints}
    for change in (beta.delete_checkpoint_from_tinker_path, beta.unpublish_checkpoint_from_tinker_path,
                   lambda path: beta.set_checkpoint_ttl_from_tinker_path(path, 7200)):
        with pytest.raises(tinker.NotFoundError):
            change(weights).result(timeout=TIMEOUT_S)
    alpha.unpublish_checkpoint_from_tinker_path(weights).result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.NotFoundError):
        beta.get_weights_info_by_tinker_path(weights).result(timeout=TIMEOUT_S)
    assert beta.get_weights_info_by_tinker_path(copied).result(timeout=TIMEOUT_S).base_model == TINY  # beta's own


def test_weights_info_and_copies(service, local_cluster):
    training = service.create_lora_training_client(base_model=TINY, rank=8, train_mlp=False).result(timeout=TIMEOUT_S)
    path = training.save_state("original").result(timeout=TIMEOUT_S).path
    rest = rest_client(local_cluster)
    info = rest.get_weights_info_by_tinker_path(path).result(timeout=TIMEOUT_S)
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp, info.train_attn) == (
        TINY, True, 8, False, True)

    copied = rest.copy_weights(path, "proj-archive", ttl_seconds=7200).result(timeout=TIMEOUT_S)
    run, kind, name = copied[len("tinker://"):].split("/")
    assert run.startswith("copy-") and (kind, name) == ("weights", "original")
    [checkpoint] = rest.list_checkpoints(run).result(timeout=TIMEOUT_S).checkpoints
    assert checkpoint.tinker_path == copied and checkpoint.expires_at is not None
    assert rest.get_training_run(run).result(timeout=TIMEOUT_S).base_model == TINY
    resumed = service.create_training_client_from_state(copied).result(timeout=TIMEOUT_S)
    assert resumed.get_info().lora_rank == 8
    archive = tinker.ServiceClient(base_url=local_cluster.api_url, api_key=API_KEY, project_id="proj-archive")
    assert archive.copy_weights(path).result(timeout=TIMEOUT_S).endswith("/weights/original")

    with httpx.Client(base_url=f"{local_cluster.api_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as api:
        body = {"source_path": path, "destination_project_id": "p"}
        retried = [api.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "same-key"}) for _ in range(2)]
        assert retried[0].json() == retried[1].json() and retried[0].status_code == 200  # a retry: the same copy
        train = api.post("/optim_step", json={"model_id": run, "seq_id": 1, "adam_params": {}})
        assert train.status_code == 410 and "cannot be trained" in train.json()["detail"]
        for bad, message in (({"source_path": path, "session_id": "s"}, "with model_seq_id"),
                             ({"source_path": path, "ttl_seconds": 5}, "out of range"),
                             ({"source_path": path, "weights_access_token": "t"}, "no weights access tokens"),
                             ({"source_path": "tinker://no-such-run/weights/x"}, "Unknown model_id")):
            refused = api.post("/copy_weights", json=bad)
            assert 400 <= refused.status_code < 500 and message in refused.json()["detail"], refused.text


def test_sessions_are_listed_shown_and_searched_for_their_tenant_only(local_cluster):
    rest, beta = rest_client(local_cluster), rest_client(local_cluster, "beta")
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key=API_KEY, user_metadata={"purpose": "search"},
                              display_name="Nightly sweep 7") as client:
        training = client.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
        training.save_state("in-session").result(timeout=TIMEOUT_S)
        session_id = client.holder.get_session_id()
        assert session_id in rest.list_sessions(limit=100).result(timeout=TIMEOUT_S).sessions
        shown = rest.get_session(session_id).result(timeout=TIMEOUT_S)
        assert shown.training_run_ids == [training.model_id] and shown.user_metadata == {"purpose": "search"}
        assert shown.display_name == "Nightly sweep 7"
        found = rest.search_sessions(types.SessionSearchRequest(display_name="sweep nightly")).result(timeout=TIMEOUT_S)
        [summary] = [s for s in found.sessions if s.session_id == session_id]
        assert (summary.owner, summary.checkpoints_count, summary.status.type) == ("local", 1, "active")
        assert summary.checkpoint_storage_bytes > 0
    finished = rest.search_sessions(types.SessionSearchRequest(
        session_id=session_id, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])])).result(
        timeout=TIMEOUT_S)
    assert [s.session_id for s in finished.sessions] == [session_id]
    assert session_id not in beta.list_sessions(limit=1000).result(timeout=TIMEOUT_S).sessions
    with pytest.raises(tinker.NotFoundError, match="Unknown session_id"):
        beta.get_session(session_id).result(timeout=TIMEOUT_S)
    assert beta.search_sessions(types.SessionSearchRequest(session_id=session_id)).result(
        timeout=TIMEOUT_S).sessions == []
    page = rest.search_sessions(types.SessionSearchRequest(limit=1)).result(timeout=TIMEOUT_S)
    following = rest.search_sessions(types.SessionSearchRequest(limit=1, cursor=page.next_cursor)).result(
        timeout=TIMEOUT_S)
    assert page.next_cursor is not None and following.sessions[0].created_at <= page.sessions[0].created_at
    assert following.sessions[0].session_id != page.sessions[0].session_id


def test_what_a_self_hosted_service_keeps_none_of_is_a_404_that_says_so(local_cluster, service):
    rest = rest_client(local_cluster)
    admin = tinker.AdminClient(base_url=local_cluster.api_url, api_key=API_KEY)
    refusals = ((lambda: admin.get_audit_log(), "keeps no audit log"),
                (lambda: rest.assign_session_project("session-x", "proj"), "keeps no projects"),
                (lambda: rest.export_session_trace("session-x"), "Unknown session_id"))
    for call, message in refusals:
        with pytest.raises(tinker.NotFoundError, match=message):
            call().result(timeout=TIMEOUT_S)
    usage = admin.get_current_checkpoint_storage_usage().result(timeout=TIMEOUT_S)
    [row] = usage.data
    assert row.org_user_urn == "tml:user:local" and row.checkpoint_count >= 0 and row.size_bytes >= 0
    # whoami reads the caller's identity from the token the SDK exchanged its key for.
    identity = rest.whoami().result(timeout=TIMEOUT_S)
    assert (identity.user_urn, identity.org_urn) == ("tml:user:local", "tml:organization:local")
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    sampler_id = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)._sampling_session_id
    answer = rest.get_sampler(sampler_id).result(timeout=TIMEOUT_S)
    assert isinstance(answer, types.GetSamplerResponse) and answer.base_model == TINY
    assert answer.sampler_id == sampler_id and answer.model_path.startswith(f"tinker://{training.model_id}/")


def test_the_cli_refuses_other_tenants_things_like_unknown_ones(alpha_service, local_cluster):
    training = trained(alpha_service)
    path = training.save_state("alpha-only").result(timeout=TIMEOUT_S).path
    for args in (("checkpoint", "info", path), ("checkpoint", "list", "--run-id", training.model_id),
                 ("run", "info", training.model_id)):
        refused = tinker_cli(local_cluster, *args, api_key=TENANT_KEYS["beta"])
        assert refused.returncode != 0 and "404" in refused.stderr, (args, refused.stderr)
        assert "Unknown training run" in refused.stderr, (args, refused.stderr)
    assert cli_json(local_cluster, "checkpoint", "info", path, api_key=TENANT_KEYS["alpha"])["tinker_path"] == path


def test_bad_input_to_the_new_routes_is_a_4xx_with_a_sentence(local_cluster):
    with httpx.Client(base_url=f"{local_cluster.api_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as api:
        cases = [
            (api.put("/training_runs/r/checkpoints/weights/x/ttl", json={"ttl_seconds": "soon"}), 422, "ttl_seconds"),
            (api.put("/training_runs/r/checkpoints/weights/x/ttl", json={"ttl_seconds": 10}), 422, "out of range"),
            (api.put("/training_runs/r/checkpoints/elsewhere/x/ttl", json={"ttl_seconds": None}), 422,
             "not of the form"),
            (api.post("/training_runs/r/checkpoints/weights/..%2F..%2Fx/publish"), 422, "heckpoint"),
            (api.post("/weights_info", json={"tinker_path": "file:///etc/passwd"}), 422, "not a tinker:// path"),
            (api.post("/weights_info", json={}), 422, "tinker_path"),
            (api.get("/training_runs/r/checkpoints/weights/x/external_weights_urls"), 422, "not an external weights"),
            (api.post("/sessions/search", json={"limit": 0}), 422, "limit"),
            (api.post("/sessions/search", json={"cursor": {"last_created_at": "yesterday", "last_session_id": "s"}}),
             422, "cursor is not one a search returned"),
            (api.get("/downloads/r/external_weights/x/f", params={"tenant": "local", "expires": 1,
                                                                  "signature": "x"}), 403, "not one lilo signed"),
            (api.get("/downloads/r/external_weights/x/f"), 422, "signature"),
        ]
        for response, status, message in cases:
            assert response.status_code == status and message in response.json()["detail"], response.text
