"""How long `lilo down` waits: the trainers' save time at stop, from the settings and the running cluster's state
file."""

import json
import shutil

import pytest

from cluster.local import read_state
from cluster.service import stop_wait_s
from helpers import short_home
from lilo.settings import SettingsError, load_settings


def test_the_save_time_at_stop_comes_from_the_environment_or_a_flag_and_sets_how_long_down_waits():
    assert load_settings(env={}).stop_save_timeout_s == 40
    assert load_settings(env={"LILO_STOP_SAVE_TIMEOUT_S": "0"}).stop_save_timeout_s == 0
    with pytest.raises(SettingsError, match="--stop-save-timeout must be 0 .no save. or more seconds"):
        load_settings(env={}, stop_save_timeout_s=-5)
    home = short_home()
    try:
        settings = load_settings(env={}, home=home)
        recorded = {"pid": 1, "status": "ready", "home": str(home), "api_url": "", "dashboard_url": "",
                    "gcs_address": None, "started_at": 0.0}
        settings.state_file.write_text(json.dumps(recorded))  # written before the field existed
        assert stop_wait_s(read_state(settings)) == 60
        settings.state_file.write_text(json.dumps({**recorded, "stop_save_timeout_s": 300}))
        assert stop_wait_s(read_state(settings)) == 320
    finally:
        shutil.rmtree(home, ignore_errors=True)
