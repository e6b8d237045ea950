"""A trainer's relay of samples to its vLLM samplers: a sample its client cancels while its adapter is still being
published to the sampler (a LoRA load takes seconds on a busy machine) fails as cancelled and never reaches vLLM.

The sampler here is a stand-in Ray actor with the sampler actor's methods: a real vLLM publish cannot be held open
on demand, and the race needs the cancel to land inside it. The real sampler's cancel, mid-generation, is tested
end to end in tests/e2e/test_vllm_sampling_sdk.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Awaitable, Callable

import pytest
import ray

from cluster.local import NAMESPACE
from cluster.sampling.plane import SamplerRelay
from lilo.backend.types import SamplingRequest
from lilo.engine.commands import Command, Kind
from lilo.errors import CancelledByClientError
from lilo.timing.critical_path import Observers

SAMPLER = "lilo-test-held-publish-sampler"


@ray.remote(num_cpus=0)
class HeldPublishSampler:
    """Ready at once; each publish waits until ``release``; counts the samples that reached it."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.publishing = 0
        self.sampled = 0

    async def ready(self) -> dict:
        return {"max_model_len": 256}

    async def publish(self, path: str, directory: str) -> None:
        self.publishing += 1
        await self.released.wait()

    async def release(self) -> None:
        self.released.set()

    async def counts(self) -> tuple[int, int]:
        return self.publishing, self.sampled

    async def sample(self, payloads: list, keys: list, traces: list) -> list:
        self.sampled += 1
        return ["sampled"]


@pytest.fixture
def held_sampler(ray_driver):
    actor = HeldPublishSampler.options(name=SAMPLER, namespace=NAMESPACE).remote()
    yield actor
    ray.kill(actor)


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_sample_cancelled_while_its_adapter_publishes_never_reaches_the_sampler(held_sampler, tmp_path):
    command = Command("tinker://run-1/sampler_weights/s1", 0, Kind.SAMPLE, "41",
                      SamplingRequest(prompt=[1, 2, 3], max_tokens=4, temperature=0.0))
    fallbacks: list[Command] = []

    def fallback() -> concurrent.futures.Future:
        fallbacks.append(command)
        return concurrent.futures.Future()

    async def scenario() -> None:
        relay = SamplerRelay([SAMPLER], tmp_path, lambda path: 1, Observers())

        async def sampler_ready() -> bool:
            return relay.choose(command) == SAMPLER

        async def publishing() -> bool:
            return (await held_sampler.counts.remote())[0] == 1

        await _until(sampler_ready)
        future = relay.relay(command, SAMPLER, fallback)
        await _until(publishing)
        assert relay.cancel("41"), "a sample whose adapter is publishing is the relay's to cancel"
        # Another sample of the same checkpoint, cancelled before its relay's task has even started.
        second = relay.relay(dataclasses.replace(command, request_id="42"), SAMPLER, fallback)
        assert relay.cancel("42"), "a sample relayed a moment ago is the relay's to cancel"
        await held_sampler.release.remote()
        for relayed in (future, second):
            with pytest.raises(CancelledByClientError, match="cancelled by its client"):
                await asyncio.wait_for(asyncio.wrap_future(relayed), 30)
        assert await held_sampler.counts.remote() == (1, 0)
        assert not fallbacks
        assert not relay.cancel("41"), "a finished sample is no longer the relay's"

    asyncio.run(scenario())
