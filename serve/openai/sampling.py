"""What an OpenAI-compatible request's ``model`` names, and the one place where its sample is dispatched.

``model`` is a served base model's name or a sampler checkpoint's ``tinker://`` path, read under the same rules as
the tinker SDK's ``create_sampling_client(model_path=...)``: the caller's own checkpoints and published ones. The
sample runs where a sampling session's would (``cluster.placement.choose_sampling_trainer``: for a checkpoint, the
trainer of the run that wrote it), and that trainer's tokenizer renders and reads the text.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Mapping, Sequence

from lilo.backend.checkpoints.paths import TINKER_SCHEME, sampler_run
from lilo.backend.registry import base_model_spec
from lilo.backend.types import SamplingRequest
from lilo.engine.commands import Command, Kind
from lilo.engine.contract import SampleResult
from lilo.errors import NotFoundError
from serve.tinker.actors import Actors
from serve.tinker.sampling import SamplingRouter

# The timing label of base-model samples (a checkpoint's are under its path, as the tinker SDK's samples are).
BASE_LABEL = "openai:"


@dataclasses.dataclass(frozen=True)
class Target:
    """A request's ``model``, resolved for its caller."""

    base_model: str
    model_path: str | None  # the sampler checkpoint; None: the bare base model
    trainer: str  # where it samples today, whose tokenizer renders and reads its text
    vocab_size: int
    eos_token_ids: Sequence[int]
    max_context_length: int


def unknown_model(model: str, base_models: Sequence[str]) -> NotFoundError:
    return NotFoundError(f"The model {model!r} does not exist here; name a served base model "
                         f"({', '.join(base_models)}; GET /oai/api/v1/models lists them) or a sampler checkpoint's "
                         "tinker:// path that save_weights_for_sampler returned.")


async def resolve_model(actors: Actors, router: SamplingRouter, model: str, context_lengths: Mapping[str, int],
                        tenant: str) -> Target:
    """The base model and checkpoint ``model`` names; a 404 for one that is not served, not a sampler checkpoint
    the caller may read, or gone. ``context_lengths``: the served base models' (read once, as the capabilities
    are)."""
    base_models = list(context_lengths)
    key = uuid.uuid4().hex  # a base model's requests spread over the trainers serving it
    if model.startswith(TINKER_SCHEME):
        sampler_run(model)  # a 400 for a path of another kind
        run = await actors.readable_run(model, tenant, unknown_model(model, base_models).args[0])
        base_model, model_path = run["base_model"], model
        trainer = await router.trainer_for(key, base_model, run["trainer"])
        await actors.trainer(trainer).check_sampler_checkpoint.remote(model_path)
    elif model in base_models:
        base_model, model_path = model, None
        trainer = await router.trainer_for(key, base_model, None)
    else:
        raise unknown_model(model, base_models)
    facts = (await router.trainer_facts())[trainer]
    return Target(base_model, model_path, trainer, facts["vocab_size"], facts["eos_token_ids"],
                  context_lengths.get(base_model) or base_model_spec(base_model).max_context_length)


async def sample_for_openai(actors: Actors, base_model: str, model_path: str | None, request: SamplingRequest,
                            trainer: str) -> SampleResult:
    """Every OpenAI-compatible sample goes through here: today on ``trainer`` (``Target.trainer``), through the
    engine as a sample that skips the models' seq order and returns its result directly (no future is recorded);
    through the checkpoint ``model_path`` names, or none for ``base_model``. The whole generation comes back at
    once."""
    command = Command(model_path or BASE_LABEL + base_model, 0, Kind.SAMPLE, f"openai-{uuid.uuid4().hex}",
                      payload=request, tokens=request.num_samples * (len(request.prompt) + request.max_tokens))
    return await actors.trainer(trainer).run.remote(command)
