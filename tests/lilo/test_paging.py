"""Paging: more models than slots, each paged out to host memory or disk and back, computing what it would have
computed resident."""

import copy

import numpy as np
import pytest
import torch

from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_state
from lilo.backend.models import build_tiny, load_base_model
from lilo.backend.paging.files import delete_page_files, find_page_files
from lilo.backend.paging.policy import Room, choose_victims, host_adapter_bytes, host_demotions, page_file_wins
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import AdamParams, Datum, LoadRequest, LoraSpec, SamplingRequest, TrainInput
from lilo.engine.commands import Command, Kind
from lilo.engine.engine import Engine, _parts
from lilo.errors import SaturatedError

MB = 2**20


@pytest.mark.parametrize("last_used, count, running, queued, victims", [
    ({"a": 3, "b": 1, "c": 2}, 1, set(), set(), ["b"]),  # the one idle longest
    ({"a": 3, "b": 1, "c": 2}, 2, set(), set(), ["b", "c"]),
    ({"a": 3, "b": 1, "c": 2}, 1, {"b"}, set(), ["c"]),  # never one running
    ({"a": 3, "b": 1, "c": 2}, 1, set(), {"b"}, ["c"]),  # not one with queued work while an idle one is left
    ({"a": 3, "b": 1}, 2, set(), {"b"}, ["a", "b"]),  # idle first, then queued, idlest of those first
    ({"a": 3, "b": 1}, 1, {"a"}, {"b"}, ["b"]),  # every other has queued work: the idlest of them goes
    ({"a": 3, "b": 1}, 1, {"a", "b"}, set(), []),  # all running: none
    ({}, 1, set(), set(), []),
])
def test_the_model_idle_longest_leaves_its_slot_never_one_with_work(last_used, count, running, queued, victims):
    assert choose_victims(last_used, count, running, queued) == victims


@pytest.mark.parametrize("host, needed, free, demoted", [
    ({"a": (2, 10), "b": (1, 10)}, 5, 5, []),  # fits already
    ({"a": (2, 10), "b": (1, 10)}, 10, 5, ["b"]),  # the least recently used goes to disk
    ({"a": (2, 10), "b": (1, 10)}, 20, 5, ["b", "a"]),
    ({"a": (2, 10), "b": (1, 10)}, 30, 5, None),  # larger than host memory: straight to disk
    ({}, 1, 0, None),
])
def test_host_memory_makes_room_by_demoting_its_least_recently_used(host, needed, free, demoted):
    assert host_demotions(host, needed, free) == demoted


def test_the_host_tier_is_the_flag_or_a_sixteenth_of_the_node():
    assert host_adapter_bytes(512, node_bytes=2**40) == 512 * MB
    assert host_adapter_bytes(None, node_bytes=16 * 2**30) == 2**30
    assert host_adapter_bytes(0, node_bytes=2**40) == 0


def test_a_batch_of_more_models_than_slots_runs_in_parts():
    taken = [(Command(m, 1, Kind.OPTIM_STEP, f"{m}:1", payload=None), None) for m in "abcde"]
    parts = _parts(taken, dict.fromkeys("abcde"), 2)
    assert [[command.model_id for command, _ in part] for part in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert _parts(taken, dict.fromkeys("abcde"), 8) == [taken]


def datum(seed: int, length: int = 16) -> Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, length)
    return Datum(tokens=tokens.tolist(), loss_inputs={
        "target_tokens": np.roll(tokens, -1).tolist(), "weights": rng.random(length).round(2).tolist()})


SPECS = {"m": LoraSpec(rank=4, seed=1), "other": LoraSpec(rank=8, seed=2, train_unembed=True)}
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)


def train(backend: TorchBackend, steps: int = 4, then: Command | None = None) -> tuple[Engine, object]:
    """Both models step in turn, the other's forward_backward between each one's forward_backward and optim_step
    (so with one slot a model is paged out holding gradients, and in again for its optim_step); then the command
    ``then``, whose result is returned with the engine."""
    result = None
    engine = Engine(backend)
    try:
        for model_id, spec in SPECS.items():
            engine.create_model(model_id, spec).result(30)
        for seq in range(1, 2 * steps, 2):
            for model_id in SPECS:
                train_input = TrainInput(data=[datum(seq * 10 + len(model_id))])
                engine.submit(Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}",
                                      payload=train_input, tokens=train_input.tokens)).result(30)
            for model_id in SPECS:
                engine.submit(Command(model_id, seq + 1, Kind.OPTIM_STEP, f"{model_id}:{seq + 1}",
                                      payload=ADAM)).result(30)
        if then is not None:
            result = engine.submit(then).result(30)
    finally:
        engine.stop()
    return engine, result


def training_state(backend: TorchBackend, model_id: str) -> list[torch.Tensor]:
    backend.make_room([model_id], (), ())
    slot = backend.adapters[model_id].slot
    flats = [backend.bank.weights, backend.optimizer.exp_avg, backend.optimizer.exp_avg_sq, backend.bank.grads]
    return [flat[slot].clone() for flat in flats] + [backend.optimizer.step_counts[slot].clone()]


def resident_and_paged(base, tmp_path, host_mb: int, disk_mb: int) -> tuple[TorchBackend, TorchBackend]:
    """A backend with a slot for each model, and one with one slot and a host or a disk tier for the rest."""
    resident = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path / "r")
    paged = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path / "p",
                         host_adapter_bytes=host_mb * MB, disk_adapter_bytes=disk_mb * MB)
    return resident, paged


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    """A tiny Qwen3-MoE: its adapters' expert tensors page with the rest."""
    return load_base_model(build_tiny(tmp_path_factory.mktemp("moe"), "tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def hybrid_base(tmp_path_factory):
    """A tiny Qwen3.5-MoE: its linear attention's adapters page with its experts' and the rest."""
    return load_base_model(build_tiny(tmp_path_factory.mktemp("hybrid"), "tiny-qwen3.5-moe"))


@pytest.mark.parametrize("host_mb, disk_mb", [(64, 0), (0, 64)], ids=["host", "disk"])
@pytest.mark.parametrize("model", ["base", "moe_base", "hybrid_base"])
def test_a_model_paged_out_after_every_step_trains_bit_for_bit_as_one_resident(request, model, tmp_path, host_mb,
                                                                               disk_mb):
    resident, paged = resident_and_paged(request.getfixturevalue(model), tmp_path, host_mb, disk_mb)
    train(resident)
    timings = train(paged)[0].timings.snapshot("m")["phases"]
    assert {"forward_backward.page_in", "optim_step.page_in", "forward_backward.page_out"} <= set(timings)
    for model_id in SPECS:
        for ours, theirs in zip(training_state(paged, model_id), training_state(resident, model_id), strict=True):
            assert torch.equal(ours, theirs)


def test_create_model_is_refused_only_when_every_tier_is_full(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path,
                           host_adapter_bytes=1, disk_adapter_bytes=0)
    backend.make_room(["a"], (), ())
    backend.add_adapter("a", LoraSpec(rank=4))
    with pytest.raises(SaturatedError, match="raise --host-adapter-mb or --disk-adapter-gb"):
        backend.make_room(["b"], (), ())
    assert set(backend.adapters) == {"a"}
    roomy = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path,
                         host_adapter_bytes=MB, disk_adapter_bytes=MB)
    for model_id in "abc":
        roomy.make_room([model_id], (), ())
        roomy.add_adapter(model_id, LoraSpec(rank=4))
    assert set(roomy.adapters) == {"c"} and set(roomy.pages.host) | set(roomy.pages.disk) == {"a", "b"}


def test_removing_a_paged_model_deletes_its_page_file(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path / "c",
                           disk_adapter_bytes=MB, page_dir=tmp_path / "pages")
    for model_id in "ab":
        backend.make_room([model_id], (), ())
        backend.add_adapter(model_id, LoraSpec(rank=4))
    assert [path.name for path in (tmp_path / "pages").iterdir()] == ["a.page.safetensors"]
    backend.remove_adapter("a")
    assert list((tmp_path / "pages").iterdir()) == [] and backend.pages.disk_used == 0


def test_create_model_succeeds_while_a_tier_has_room_and_says_what_to_raise_when_none_has(base, tmp_path):
    roomy = Engine(TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path,
                                host_adapter_bytes=16 * MB))
    full = Engine(TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path))
    try:
        assert [roomy.create_model(m, LoraSpec(rank=4)).result(30) for m in "abc"] == ["a", "b", "c"]
        assert roomy._backend.room > 0
        full.create_model("a", LoraSpec(rank=4)).result(30)
        assert full._backend.room == 0
        with pytest.raises(SaturatedError, match="--max-adapters.*--host-adapter-mb or --disk-adapter-gb"):
            full.create_model("b", LoraSpec(rank=4)).result(30)
    finally:
        roomy.stop()
        full.stop()


def test_sampling_a_paged_out_model_pages_it_in_and_samples_as_resident(base, tmp_path):
    resident = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path / "r")
    paged = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path / "p",
                         disk_adapter_bytes=16 * MB)
    request = SamplingRequest(prompt=[1, 2, 3, 4], max_tokens=6, temperature=1.0, seed=7, prompt_logprobs=True)
    sample = Command("m", 0, Kind.SAMPLE, "s", payload=request, tokens=10)
    # "other" stepped last, so "m" waits on disk until its sample pages it in.
    assert train(paged, steps=1, then=sample)[1] == train(resident, steps=1, then=sample)[1]
    assert "m" in paged.adapters and "other" in paged.pages


def test_when_the_idlest_model_does_not_fit_the_next_idlest_that_does_leaves(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path,
                           host_adapter_bytes=MB)
    for model_id, rank in (("big", 8), ("small", 4), ("new", 4)):
        backend.make_room([model_id], (), ())
        backend.add_adapter(model_id, LoraSpec(rank=rank))
    assert set(backend.adapters) == {"big", "new"} and set(backend.pages.host) == {"small"}


def test_a_page_file_read_ahead_is_used_once_and_never_after_its_model_was_paged_out_again(tmp_path):
    from lilo.backend.paging.store import PagedState, PageStore

    store = PageStore(host_bytes=0, disk_bytes=MB, directory=tmp_path)
    first = PagedState(LoraSpec(rank=4), 3, False, torch.arange(12.0).view(3, 4))
    store.put("m", first, last_used=1)
    assert store.stage("m") is not None and store.stage("m") is None  # staged once
    (tmp_path / "m.page.safetensors").unlink()  # the page-in must not need the file now
    state, tier = store.take("m")
    assert tier == "disk" and torch.equal(state.data, first.data) and state.step == 3
    store.put("m", first, last_used=2)
    store.stage("m")
    store.take("m")
    second = PagedState(LoraSpec(rank=4), 4, True, torch.ones(4, 4))
    store.put("m", second, last_used=3)  # rewritten since it was staged: the file, not the stale copy
    state, _ = store.take("m")
    assert torch.equal(state.data, second.data) and state.step == 4 and state.has_grads
    assert store.disk_used == 0 and not store.staged


def test_models_waiting_their_turn_are_read_ahead_and_train_bit_for_bit_as_resident(base, tmp_path):
    models = [f"m{i}" for i in range(6)]

    def run(backend: TorchBackend) -> Engine:
        engine = Engine(backend, coalesce=False)
        try:
            for i, model_id in enumerate(models):
                engine.create_model(model_id, LoraSpec(rank=4, seed=i)).result(30)
            for seq in (1, 3):
                steps = []
                for i, model_id in enumerate(models):
                    train_input = TrainInput(data=[datum(10 * seq + i)])
                    steps.append(engine.submit(Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}",
                                                       payload=train_input, tokens=train_input.tokens)))
                    steps.append(engine.submit(Command(model_id, seq + 1, Kind.OPTIM_STEP, f"{model_id}:{seq + 1}",
                                                       payload=ADAM)))
                [step.result(30) for step in steps]
        finally:
            engine.stop()
        return engine

    resident = TorchBackend(copy.deepcopy(base), max_adapters=6, max_rank=8, checkpoint_dir=tmp_path / "r")
    paged = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path / "p",
                         disk_adapter_bytes=64 * MB)
    run(resident)
    phases = run(paged).timings.snapshot()["phases"]
    assert "prefetch.page_in" in phases
    for model_id in models:
        for ours, theirs in zip(training_state(paged, model_id), training_state(resident, model_id), strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("paged_at, captured_at, page_wins", [
    (20.0, 10.0, True),  # paged out after the checkpoint was captured: the page file holds the later state
    (10.0, 20.0, False),  # a checkpoint captured after (the page file is left over from before): the checkpoint
    (10.0, 10.0, False),  # a tie: what the client was told is saved
    (10.0, None, True),  # no checkpoint
    (None, 10.0, False),  # no page file
    (None, None, False),
])
def test_a_restore_takes_the_copy_whose_state_left_its_slot_last(paged_at, captured_at, page_wins):
    assert page_file_wins(paged_at, captured_at) is page_wins


def test_a_trainer_says_its_room_per_tier_in_models_of_the_largest_size(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path)
    largest = 3 * backend.bank.weights.shape[1] * 4
    backend.pages.host_bytes, backend.pages.disk_bytes = 3 * largest, 5 * largest + 1
    backend.make_room(["a"], (), ())
    backend.add_adapter("a", LoraSpec(rank=4))
    assert backend.room_by_tier() == Room(device=1, host=3, disk=5) and backend.room == 9


@pytest.mark.parametrize("host_mb, disk_mb", [(64, 0), (0, 64)], ids=["host", "disk"])
def test_a_paged_model_is_saved_from_its_paged_state_as_it_would_be_from_a_slot(base, tmp_path, host_mb, disk_mb):
    resident, paged = resident_and_paged(base, tmp_path, host_mb, disk_mb)
    train(resident)
    train(paged)
    (waiting,) = set(SPECS) - set(paged.adapters)
    for model_id in SPECS:
        ours = read_state(local_directory(paged.checkpoint_dir, paged.save_now(model_id, "stop")))
        theirs = read_state(local_directory(resident.checkpoint_dir, resident.save_now(model_id, "stop")))
        assert ours.step == theirs.step and ours.spec == theirs.spec and ours.tensors.keys() == theirs.tensors.keys()
        assert all(torch.equal(ours.tensors[key], theirs.tensors[key]) for key in theirs.tensors)
    assert waiting in paged.pages and waiting not in paged.adapters  # saved where it waits: not paged in
    assert paged.holds(waiting) and not paged.holds("nobody")


def test_a_page_file_describes_itself_and_a_torn_one_is_passed_over(tmp_path):
    from lilo.backend.paging.store import PagedState, PageStore, read_page_file

    store = PageStore(host_bytes=0, disk_bytes=MB, directory=tmp_path / "lilo-trainer-0")
    state = PagedState(LoraSpec(rank=4, seed=3), 7, True, torch.arange(16.0).view(4, 4), paged_at=123.5)
    store.put("m", state, last_used=1)
    store.put("other", PagedState(LoraSpec(rank=4), 1, False, torch.ones(3, 4)), last_used=2)
    (page,) = find_page_files(tmp_path, "m")
    assert (page.model_id, page.spec, page.step, page.paged_at) == ("m", LoraSpec(rank=4, seed=3), 7, 123.5)
    back = read_page_file(page)
    assert torch.equal(back.data, state.data) and back.has_grads and back.step == 7
    torn = tmp_path / "lilo-trainer-1" / page.path.name
    torn.parent.mkdir()
    torn.write_bytes(page.path.read_bytes()[:50])  # a machine crash mid-write
    assert find_page_files(tmp_path, "m") == [page]
    delete_page_files(tmp_path, "m")
    assert find_page_files(tmp_path, "m") == [] and not torn.exists() and find_page_files(tmp_path, "other")


def test_a_model_created_for_a_restore_leaves_no_restorable_page_file_until_its_load_has_run(base, tmp_path):
    # Else a trainer dying between the two would bring the model back as the fresh adapter, newer than its checkpoint.
    backend = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path / "c",
                           disk_adapter_bytes=MB, page_dir=tmp_path / "pages" / "t0")
    backend.restoring.add("a")
    for model_id in "ab":
        backend.make_room([model_id], (), ())
        backend.add_adapter(model_id, LoraSpec(rank=4))
    assert "a" in backend.pages and find_page_files(tmp_path / "pages", "a") == []
    saved = backend.save_now("b", "x")
    backend.make_room(["a"], (), ())
    backend.load_checkpoint(Command("a", 0, Kind.LOAD_WEIGHTS, "restore-a", payload=LoadRequest(path=saved)))
    backend.make_room(["b"], (), ())
    assert [page.model_id for page in find_page_files(tmp_path / "pages", "a")] == ["a"] and not backend.restoring
