"""Fair share by tenant: the scheduler (``next_batch`` with ``FairShare``'s service) shares passes that cannot hold
every ready command by tenant weight, whatever the number of models each runs, and never leaves room empty."""

from collections import Counter

from lilo.engine.commands import Command, Kind
from lilo.engine.fair_share import FairShare
from lilo.engine.scheduler import next_batch

STEP_TOKENS = 100
BUDGET = 2 * STEP_TOKENS  # a pass holds two steps


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(model: str, seq: int, tenant: str, weight: float = 1.0) -> Command:
    return Command(model, seq, Kind.FORWARD_BACKWARD, f"{model}:{seq}", payload=None, tokens=STEP_TOKENS,
                   tenant=tenant, weight=weight)


def run_passes(models: dict[str, tuple[str, float]], passes: int, fair: FairShare, clock: Clock,
               ready: set[str] | None = None) -> Counter:
    """``passes`` passes over models that always have a step ready (``ready``: only those), each pass a second
    long; how many steps each tenant got."""
    rotation = list(models)
    seqs: Counter = Counter()
    given: Counter = Counter()
    for _ in range(passes):
        heads = {model: step(model, seqs[model], *models[model]) for model in rotation
                 if ready is None or model in ready}
        batch = next_batch(heads, rotation, BUDGET, service=fair.service(h.tenant for h in heads.values()))
        fair.charge(batch)
        rotation.remove(batch[0].model_id)
        rotation.append(batch[0].model_id)
        for command in batch:
            seqs[command.model_id] += 1
            given[command.tenant] += 1
        clock.now += 1.0
    return given


def test_a_tenant_with_one_model_gets_as_many_steps_as_one_with_six():
    clock = Clock()
    models = {**{f"a{i}": ("a", 1.0) for i in range(6)}, "b0": ("b", 1.0)}
    given = run_passes(models, 60, FairShare(clock), clock)
    assert given["a"] + given["b"] == 120  # every pass full
    assert given["b"] == 60 and given["a"] == 60


def test_weights_two_to_one_give_two_to_one():
    clock = Clock()
    models = {**{f"a{i}": ("a", 2.0) for i in range(3)}, **{f"b{i}": ("b", 1.0) for i in range(3)}}
    given = run_passes(models, 60, FairShare(clock), clock)
    assert given["a"] == 80 and given["b"] == 40


def test_an_idle_tenants_room_goes_to_the_others_and_comes_back_without_a_burst():
    clock = Clock()
    fair = FairShare(clock)
    models = {**{f"a{i}": ("a", 1.0) for i in range(6)}, "b0": ("b", 1.0), "b1": ("b", 1.0)}
    run_passes(models, 10, fair, clock)
    alone = run_passes(models, 20, fair, clock, ready={f"a{i}" for i in range(6)})
    assert alone == Counter({"a": 40})  # b idle: a fills every pass
    back = run_passes(models, 20, fair, clock)
    # b takes its half again at once, and no more: its two models could fill whole passes to make up for its idle
    # time, and get none.
    assert back == Counter({"a": 20, "b": 20})


def test_without_tenants_the_rotation_decides_as_before():
    heads = {model: step(model, 1, "local") for model in ("m0", "m1", "m2")}
    big = Command("m1", 1, Kind.FORWARD_BACKWARD, "m1:1", payload=None, tokens=BUDGET, tenant="local")
    batch = next_batch({**heads, "m1": big}, ["m1", "m0", "m2"], BUDGET)
    assert [command.model_id for command in batch] == ["m1"]  # the anchor runs however large; nothing else fits
    batch = next_batch(heads, ["m2", "m0", "m1"], BUDGET)
    assert [command.model_id for command in batch] == ["m2", "m0"]
