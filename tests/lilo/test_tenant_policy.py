"""The tenants file (parsing, errors that say what to fix, re-reading on change) and the rate limits the futures DB
applies with it (requests in flight, tokens per minute: 429s with how long to wait)."""

import os

import pytest

from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError, RateLimitedError
from lilo.futures.admission import WINDOW_S, Admission
from lilo.tenant_policy import CHECK_EVERY_S, PolicyFile, TenantLimits, TenantsFileError, parse_tenants

EXAMPLE = """
[default]
max_models = 4

[tenants.alice]
weight = 2
max_rank = 32
base_models = ["lilo/tiny-llama"]
train_tokens_per_min = 1000

[tenants.bob]
max_models = 1
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_takes_its_table_over_the_default_and_others_take_the_default():
    policy = parse_tenants(EXAMPLE, "t.toml")
    assert policy.of("alice") == TenantLimits(weight=2, max_models=4, max_rank=32, base_models=("lilo/tiny-llama",),
                                              train_tokens_per_min=1000)
    assert policy.of("bob") == TenantLimits(max_models=1)
    assert policy.of("carol") == TenantLimits(max_models=4)


@pytest.mark.parametrize(("text", "says"), [
    ("[tenants.a]\nweight = 0\n", r"\[tenants.a\].weight must be a number above 0"),
    ("[tenants.a]\nmax_models = 1.5\n", r"max_models must be a whole number"),
    ("[tenants.a]\nmax_modles = 1\n", r"unknown keys \(max_modles\); use weight, max_models"),
    ("[tenant.a]\n", r"unknown tables \(tenant\); use \[default\] and \[tenants.NAME\]"),
    ("[tenants.a]\nbase_models = 'x'\n", r"base_models must be a list of base model names"),
    ("[tenants.a\n", r"is not valid TOML"),
])
def test_a_malformed_file_says_what_to_fix(text, says):
    with pytest.raises(TenantsFileError, match=says):
        parse_tenants(text, "t.toml")


def test_admin_marks_a_tenant_whose_console_sees_every_tenant_and_is_no_limit():
    policy = parse_tenants(EXAMPLE + "\n[tenants.ops]\nadmin = true\n\n[tenants.eve]\nadmin = false\n", "t.toml")
    assert policy.admins == {"ops"} and policy.is_admin("ops")
    assert not policy.is_admin("eve") and not policy.is_admin("alice") and not policy.is_admin("carol")
    assert policy.of("ops") == TenantLimits(max_models=4)  # the default's limits, admin or not
    assert not parse_tenants(EXAMPLE, "t.toml").admins


@pytest.mark.parametrize(("text", "says"), [
    ("[tenants.a]\nadmin = 1\n", r"\[tenants.a\].admin must be true or false, not 1"),
    ("[default]\nadmin = true\n", r"\[default\] may not set admin .*\[tenants.NAME\] table"),
])
def test_admin_is_true_or_false_and_only_in_a_tenants_own_table(text, says):
    with pytest.raises(TenantsFileError, match=says):
        parse_tenants(text, "t.toml")


def test_the_file_is_re_read_when_it_changes_and_a_bad_version_keeps_the_last_good_one(tmp_path):
    path, clock = tmp_path / "tenants.toml", Clock()
    path.write_text(EXAMPLE)
    policy = PolicyFile(path, clock=clock)
    assert policy.current().of("bob").max_models == 1
    path.write_text(EXAMPLE.replace("max_models = 1", "max_models = 3"))
    os.utime(path, ns=(1, 1))  # a change the mtime shows, however fast the write
    assert policy.current().of("bob").max_models == 1  # looked at once a second
    clock.now += CHECK_EVERY_S
    assert policy.current().of("bob").max_models == 3
    path.write_text("[tenants.bob\n")
    clock.now += CHECK_EVERY_S
    assert policy.current().of("bob").max_models == 3 and "is not valid TOML" in policy.error
    path.write_text(EXAMPLE)
    assert policy.reload() and policy.current().of("bob").max_models == 1 and policy.error is None


def test_in_flight_requests_over_the_limit_wait_until_some_finish():
    admission, limits = Admission(Clock()), TenantLimits(max_inflight=2)
    for _ in range(2):
        admission.check("a", limits, Kind.OPTIM_STEP, 0)
        admission.admitted("a", Kind.OPTIM_STEP, 0)
    with pytest.raises(RateLimitedError, match=r"'a' has 2 requests in flight.*max_inflight 2") as refused:
        admission.check("a", limits, Kind.OPTIM_STEP, 0)
    assert refused.value.retry_after_s > 0
    admission.check("b", limits, Kind.OPTIM_STEP, 0)  # another tenant's count
    admission.check("a", limits, Kind.REFUSED, 0)  # lilo's own record of a spent seq is never refused
    admission.finished({1: "a"})
    admission.check("a", limits, Kind.OPTIM_STEP, 0)
    admission.recount({"a": 2})
    with pytest.raises(RateLimitedError):
        admission.check("a", limits, Kind.OPTIM_STEP, 0)


def test_tokens_per_minute_are_a_sliding_window_that_says_how_long_to_wait():
    clock = Clock()
    admission, limits = Admission(clock), TenantLimits(train_tokens_per_min=1000, sample_tokens_per_min=10)
    admission.check("a", limits, Kind.FORWARD_BACKWARD, 600)
    admission.admitted("a", Kind.FORWARD_BACKWARD, 600)
    clock.now += 20
    admission.check("a", limits, Kind.FORWARD, 300)
    admission.admitted("a", Kind.FORWARD, 300)
    with pytest.raises(RateLimitedError, match=r"sent 900 tokens in the last minute.*has 200.*train_tokens_per_min "
                                                r"of 1000") as refused:
        admission.check("a", limits, Kind.FORWARD_BACKWARD, 200)
    assert refused.value.retry_after_s == pytest.approx(WINDOW_S - 20)  # when the first 600 age out
    admission.check("a", limits, Kind.OPTIM_STEP, 0)  # optimizer steps and samples count elsewhere
    admission.check("a", limits, Kind.SAMPLE, 10)
    with pytest.raises(InvalidRequestError, match=r"has 1001 tokens, more than tenant 'a' may send in a minute"):
        admission.check("a", limits, Kind.FORWARD_BACKWARD, 1001)
    clock.now += WINDOW_S - 20
    admission.check("a", limits, Kind.FORWARD_BACKWARD, 600)


def test_a_rate_limit_crosses_processes_with_its_wait():
    import pickle

    error = pickle.loads(pickle.dumps(RateLimitedError("slow down", 12.5)))
    assert str(error) == "slow down" and error.retry_after_s == 12.5


def test_a_coalesced_pass_is_charged_to_its_tenants_by_tokens():
    from lilo.timing.critical_path import Operation
    from lilo.timing.tenant_usage import TenantUsage

    usage = TenantUsage()
    for request_id, tenant, tokens in (("1", "a", 300), ("2", "b", 100), ("3", "a", 0)):
        usage.begin(Operation("m", request_id, Kind.FORWARD_BACKWARD, 0.0, tenant, tokens))
    usage.span(["m1", "m2"], "forward_backward", "compute", 10.0, 14.0, request_ids=["1", "2"])
    usage.span(["m1"], "page_in:optim_step", "compute", 14.0, 15.0, request_ids=["3"])  # not work for a request
    usage.span(["m1"], "optim_step", "compute", 15.0, 16.0, request_ids=["3"])
    assert usage.snapshot() == {"a": {"execute_s": 3.0 + 1.0, "commands": 2}, "b": {"execute_s": 1.0, "commands": 1}}


def test_the_futures_file_adds_up_each_tenants_usage(tmp_path):
    from lilo.futures.store import FuturesStore

    store = FuturesStore(str(tmp_path / "futures.db"))
    store.add_usage({"a": {"train_tokens": 100, "requests": 2}, "b": {"sample_tokens": 7, "requests": 1}})
    store.add_usage({"a": {"train_tokens": 50, "requests": 1}})
    store.add_model("m", "base", {"rank": 4}, tenant="a")
    assert store.usage() == {"a": {"train_tokens": 150, "sample_tokens": 0, "requests": 3, "models": 1},
                             "b": {"train_tokens": 0, "sample_tokens": 7, "requests": 1, "models": 0}}
    assert store.usage("b") == {"b": {"train_tokens": 0, "sample_tokens": 7, "requests": 1, "models": 0}}
    assert store.loaded_models("a") == 1 and store.loaded_models("b") == 0
