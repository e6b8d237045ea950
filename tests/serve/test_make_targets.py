"""What the two commands run, read from make's own dry run (``make -n -B``: every command of the target and its
prerequisites, none run): the demo installs only what it runs, so a user without root can run it; the tests also
install the console test's browser, the one step that needs apt-get."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(target: str) -> str:
    return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_make_demo_needs_no_root_and_no_browser():
    commands = dry_run("demo")
    assert "lilo demo" in commands and "pip install" in commands
    assert not any(word in commands for word in ("apt-get", "sudo", "chromium"))


def test_make_test_installs_the_browser_as_root_or_through_sudo_or_says_how():
    commands = dry_run("test")
    assert "apt-get install -y -qq chromium chromium-driver" in commands and "sudo" in commands
    assert "install them (apt-get install chromium chromium-driver) as root" in commands
