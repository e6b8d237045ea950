"""Fair share by tenant, and by model within a tenant: the scheduler (``next_batch`` with ``FairShare``'s service)
shares passes that cannot hold every ready command by tenant weight, whatever the number of models each runs, gives a
tenant's places to its models evenly, and never leaves room empty."""

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
               ready: set[str] | None = None, resting: bool = False, by_model: bool = False) -> Counter:
    """``passes`` passes over models that always have a step ready (``ready``: only those; ``resting``: but not in the
    pass right after their own, as a lockstep client sitting out its optimizer step and round trip), each pass a
    second long; how many steps each tenant (``by_model``: each model) got."""
    rotation = list(models)
    seqs: Counter = Counter()
    given: Counter = Counter()
    rested: set[str] = set()
    for _ in range(passes):
        heads = {model: step(model, seqs[model], *models[model]) for model in rotation
                 if (ready is None or model in ready) and model not in rested}
        batch = next_batch(heads, rotation, BUDGET, service=fair.service(heads))
        fair.charge((command.model_id, command) for command in batch)
        rotation.remove(batch[0].model_id)
        rotation.append(batch[0].model_id)
        for command in batch:
            seqs[command.model_id] += 1
            given[command.model_id if by_model else command.tenant] += 1
        rested = {command.model_id for command in batch} if resting else set()
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


def test_a_tenants_models_share_its_places_evenly_when_each_sits_out_the_pass_after_its_own():
    # Lockstep clients: a model that ran is not ready for the next pass. Ordered by tenant and rotation alone, the
    # model filled in beside the other tenant's anchor never moved back in the rotation and took every one of its
    # tenant's places (a3 and b6 stepped, a0..a5 but a3 starved).
    clock = Clock()
    models = {**{f"a{i}": ("a", 1.0) for i in range(6)}, "b6": ("b", 1.0)}
    given = run_passes(models, 120, FairShare(clock), clock, resting=True, by_model=True)
    a_steps = [given[f"a{i}"] for i in range(6)]
    assert max(a_steps) - min(a_steps) <= 1, given
    assert given["b6"] == 60, given  # b's one model is in every pass it is ready for: every other one


def test_models_with_different_step_sizes_share_their_tenants_tokens_evenly():
    clock = Clock()
    fair = FairShare(clock)
    sizes = {"small": STEP_TOKENS // 2, "large": STEP_TOKENS}
    rotation, seqs, tokens = list(sizes), Counter(), Counter()
    for _ in range(90):
        heads = {model: Command(model, seqs[model], Kind.FORWARD_BACKWARD, f"{model}:{seqs[model]}", payload=None,
                                tokens=size, tenant="a") for model, size in sizes.items()}
        # A third model's step is always ready and fills what is left, so the two above compete for places.
        heads["filler"] = step("filler", seqs["filler"], "a")
        batch = next_batch(heads, rotation + ["filler"], BUDGET, service=fair.service(heads))
        fair.charge((command.model_id, command) for command in batch)
        for command in batch:
            seqs[command.model_id] += 1
            tokens[command.model_id] += command.tokens
        clock.now += 1.0
    assert abs(tokens["small"] - tokens["large"]) <= STEP_TOKENS, tokens
    assert abs(tokens["filler"] - tokens["large"]) <= STEP_TOKENS, tokens


def test_a_model_back_from_idle_takes_its_place_again_without_a_burst():
    clock = Clock()
    fair = FairShare(clock)
    models = {f"a{i}": ("a", 1.0) for i in range(4)}
    run_passes(models, 10, fair, clock)
    run_passes(models, 20, fair, clock, ready={"a0", "a1", "a2"})  # a3 idles 20 s
    back = run_passes(models, 20, fair, clock, by_model=True)
    assert set(back.values()) == {10}, back  # not 20 for a3 to make up for its idle time


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
