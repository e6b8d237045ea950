"""The console (/console) against the session cluster: its overview route (a key needed, only the caller's records,
every tenant's for an admin of the tenants file), and the page itself in a real headless browser (Debian's chromium
through Selenium): it signs in, shows the models and their critical-path bars, and another tenant's key sees none
of them. With LILO_CONSOLE_SCREENSHOT=PATH the browser test also saves what it showed (docs/console.png)."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import ray
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from conftest import TENANT_KEYS
from helpers import API_KEY, eventually, unload_models

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
STEPS = 4
OVERVIEW = "/api/v1/console/overview"
SCREENSHOT = "LILO_CONSOLE_SCREENSHOT"
CHROMIUM, CHROMEDRIVER = "chromium", "chromedriver"


def datum(seed: int) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(3, 1000, 16).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 15})


def trained(service: tinker.ServiceClient, seed: int, rank: int = 4):
    training = service.create_lora_training_client(base_model=TINY, rank=rank).result(timeout=TIMEOUT_S)
    for _ in range(STEPS):
        training.forward_backward([datum(seed)], "cross_entropy").result(timeout=TIMEOUT_S)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=TIMEOUT_S)
    return training


@pytest.fixture(scope="module")
def models(local_cluster):
    """Three models of the tenant ``local`` trained at once (their steps share passes and wait on each other; one
    has a checkpoint) and one of ``alpha``."""
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key=API_KEY) as local, \
            tinker.ServiceClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS["alpha"]) as alpha, \
            ThreadPoolExecutor(3) as clients:
        ours = list(clients.map(lambda seed_rank: trained(local, *seed_rank), ((1, 4), (2, 8), (3, 4))))
        ours[0].save_state("console-step-3").result(timeout=TIMEOUT_S)
        theirs = trained(alpha, 4)
        try:
            yield [training.model_id for training in ours], theirs.model_id
        finally:
            unload_models(local_cluster.api_url, [training.model_id for training in ours])
            unload_models(local_cluster.api_url, [theirs.model_id], api_key=TENANT_KEYS["alpha"])


def overview(local_cluster, key: str | None, reader: str = "") -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.get(f"{local_cluster.api_url}{OVERVIEW}", params={"reader": reader} if reader else {},
                     headers=headers, timeout=60)


def test_the_overview_needs_a_key_and_answers_only_the_callers_models(local_cluster, models):
    ours, theirs = models
    refused = overview(local_cluster, None)
    assert refused.status_code == 401 and "X-API-Key" in refused.json()["detail"]

    answer = overview(local_cluster, API_KEY, reader="test-overview").raise_for_status().json()
    assert answer["tenant"] == "local" and answer["admin"] is False
    shown = {model["model_id"]: model for model in answer["models"]}
    assert set(ours) <= set(shown) and theirs not in shown
    assert {model["tenant"] for model in answer["models"]} == {"local"}
    for model_id in ours:
        model = shown[model_id]
        assert model["state"] == "loaded" and model["trainer"] and model["tier"] in ("device", "host", "disk"), model
        path = model["critical_path"]  # this reader's first interval: everything since the trainer started
        assert path["steps"] == STEPS and path["seconds"]["execute"] > 0 and path["mean_batch"] >= 1, path
    # The trainers: every one with its slots and room, naming only the caller's models.
    trainers = answer["trainers"]
    assert trainers and all(trainer["slots"] and trainer["room"] is not None for trainer in trainers), trainers
    named = {model_id for trainer in trainers for model_id in trainer["model_ids"]}
    assert set(ours) <= named and named <= set(shown) and "sampling" not in trainers[0]
    assert any(checkpoint["model_id"] == ours[0] and checkpoint["size_bytes"] > 0 and
               checkpoint["checkpoint_id"] == "weights/console-step-3" for checkpoint in answer["checkpoints"])
    assert answer["sessions"] and {session["owner"] for session in answer["sessions"]} == {"local"}

    # The same reader's next interval starts where the last ended: nothing ran since.
    again = overview(local_cluster, API_KEY, reader="test-overview").raise_for_status().json()
    assert all(model["critical_path"]["steps"] == 0 for model in again["models"] if model["model_id"] in ours)

    other = overview(local_cluster, TENANT_KEYS["beta"]).raise_for_status()
    assert other.json()["tenant"] == "beta"
    assert not any(model_id in other.text for model_id in [*ours, theirs])


def test_a_tenant_the_tenants_file_marks_admin_sees_every_tenant(local_cluster, models, ray_driver, tmp_path):
    ours, theirs = models
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text("[tenants.beta]\nadmin = true\n")
    # What `lilo up --tenants-file` does; the session cluster runs without one, which is put back after.
    ray.get(futures.use_tenants_file.remote(str(tenants_file)))
    try:
        answer = overview(local_cluster, TENANT_KEYS["beta"]).raise_for_status().json()
        alpha = overview(local_cluster, TENANT_KEYS["alpha"]).raise_for_status().json()
    finally:
        ray.get(futures.use_tenants_file.remote(None))
    assert answer["admin"] is True
    owners = {model["model_id"]: model["tenant"] for model in answer["models"]}
    assert all(owners.get(model_id) == "local" for model_id in ours) and owners.get(theirs) == "alpha"
    assert {ours[0], theirs} <= {model_id for trainer in answer["trainers"] for model_id in trainer["model_ids"]}
    # Only the admin's own view widens: another tenant's stays its own.
    assert alpha["admin"] is False and theirs in {model["model_id"] for model in alpha["models"]}
    assert {model["tenant"] for model in alpha["models"]} == {"alpha"}


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path, chromium = shutil.which(CHROMEDRIVER), shutil.which(CHROMIUM)
    if driver_path is None or chromium is None:
        pytest.fail("The console's test needs Debian's chromium and chromium-driver on PATH; `make test` installs "
                    "them (apt-get install chromium chromium-driver).")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100"):
        options.add_argument(argument)
    # The driver on disk, never one Selenium Manager would download.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def sign_in(driver, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = eventually(lambda: (found := driver.find_element(By.ID, "api-key")).is_displayed() and found,
                       "the console showing the sign-in form")
    field.send_keys(key)
    field.submit()


def bars(driver) -> dict[str, float]:
    """model id -> the seconds its row's bar draws, summed over its segments."""
    return driver.execute_script("""
        const out = {};
        for (const row of document.querySelectorAll('#models tbody tr')) {
          out[row.dataset.modelId] = [...row.querySelectorAll('.seg')]
            .reduce((sum, seg) => sum + Number(seg.dataset.seconds), 0);
        }
        return out;""")


def test_the_console_page_signs_in_shows_the_models_and_their_bars_and_another_key_sees_none(local_cluster, models,
                                                                                            browser):
    from selenium.webdriver.common.by import By

    ours, theirs = models
    browser.get(f"{local_cluster.api_url}/console")
    sign_in(browser, API_KEY)
    shown = eventually(lambda: (drawn := bars(browser)) and all(drawn.get(model_id, 0) > 0 for model_id in ours)
                       and drawn, "the console showing the models' bars")
    assert theirs not in shown
    assert browser.find_element(By.ID, "tenant").text == "local"
    assert browser.execute_script("return sessionStorage.getItem('lilo.console.key')") == API_KEY
    assert browser.execute_script("return localStorage.length") == 0
    trainer_rows = browser.find_elements(By.CSS_SELECTOR, "#trainers tr[data-trainer]")
    assert trainer_rows and any(ours[0] in row.text for row in trainer_rows)
    assert "console-step-3" in browser.find_element(By.ID, "checkpoints").text
    if os.environ.get(SCREENSHOT):
        browser.save_screenshot(os.environ[SCREENSHOT])

    browser.find_element(By.ID, "sign-out").click()
    assert browser.execute_script("return sessionStorage.getItem('lilo.console.key')") is None
    sign_in(browser, TENANT_KEYS["beta"])
    eventually(lambda: browser.find_element(By.ID, "tenant").text == "beta",
               "the console showing the other tenant's view")
    assert not set(bars(browser)) & {*ours, theirs}
    page = browser.page_source
    assert not any(model_id in page for model_id in [*ours, theirs])
