"""TorchBackend: many adapters trained on one frozen base model, their steps coalesced into one pass.

Implements the engine's ``Backend`` contract (``lilo.engine.contract``): adapters in slots, ``forward_backward``
over the rows of every command in a batch at once (each row routed to its adapter's slot), and ``optim_step`` as one
fused AdamW over the slots of every model in the call. One request's loss and gradients never depend on its batch
mates: a row's LoRA delta and gradient touch only its own slot, and losses are per-datum sums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Collection, Container, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from lilo.backend import sampling
from lilo.backend.training import batch_tokens, losses, packing, token_logprobs
from lilo.backend.checkpoints.paths import PEFT_CONFIG, TINKER_SCHEME, checked_name, tinker_path
from lilo.backend.checkpoints.stored import CheckpointShelf
from lilo.backend.checkpoints.state import AdapterState, read_peft, read_state, write_peft, write_state
from lilo.backend.training.loss_inputs import check_train_input
from lilo.backend.adapters.bank import LoraBank
from lilo.backend.adapters.lora import BASE_SLOT, BATCHED, GROUPED, RUNS
from lilo.backend.adapters.dimuon import SlotDimuon
from lilo.backend.adapters.optimizer import SlotAdamW
from lilo.backend.paging.mirror import PageMirror
from lilo.backend.paging.store import PagedState, PageRestore, PageStore
from lilo.backend.paging.policy import PageMove, Room, Tier, choose_victims
from lilo.backend.training.recompute import recomputed_layers
from lilo.backend.sharding.exchange import broadcast_slots, sum_gradients
from lilo.backend.sharding.group import ShardedBase
from lilo.backend.sharding.plans import Peers, Plan, SamplePlan, SlotUpdate, TrainPlan, TrainRow
from lilo.backend.types import (
    OPTIMIZERS, AdamParams, Datum, DatumImage, DimuonParams, LoadRequest, LoraSpec, SamplingRequest, SaveRequest,
    TrainInput,
)
from lilo.backend.vision import ImageLayout, multimodal_inputs
from lilo.engine.commands import Command, Kind
from lilo.engine.contract import ForwardBackwardResult, LoadResult, OptimStepResult, SampleResult, SaveResult
from lilo.storage import Storage
from lilo.errors import InvalidRequestError, NotFoundError, SaturatedError, TooLargeError, UnavailableError

DEFAULT_MAX_ADAPTERS = 16
DEFAULT_MAX_RANK = 32
# Slots beyond max_adapters that only sampler checkpoints use: sampling a saved checkpoint works while training
# models hold every training slot.
DEFAULT_SAMPLER_SLOTS = 2
# Padded tokens per forward/backward pass; a larger request is split into micro-batches.
DEFAULT_MAX_BATCH_TOKENS = 8192


@dataclasses.dataclass
class Adapter:
    slot: int
    spec: LoraSpec


class TorchBackend:
    def __init__(self, model: nn.Module, *, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 max_rank: int = DEFAULT_MAX_RANK, sampler_slots: int = DEFAULT_SAMPLER_SLOTS,
                 checkpoint_dir: Path | None = None, storage: Storage | None = None,
                 page_storage: Storage | None = None,
                 base_model_name: str = "", max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 decode: sampling.Decode | None = None, host_adapter_bytes: int = 0, disk_adapter_bytes: int = 0,
                 page_dir: Path | None = None, sharded: ShardedBase | None = None, optimizer: bool = True,
                 images: ImageLayout | None = None, pack: bool = True) -> None:
        self.model = model.eval()
        self.decoder = model.get_decoder()
        # A vision-language model's image layout, and its multimodal model (vision tower and language model), which
        # a pass with images runs instead of the language model alone.
        self.images = images
        self.multimodal = model.model if images is not None else None
        self.device = next(model.parameters()).device
        self.decode = decode  # the base model's detokenizer, for stop strings
        self.max_batch_tokens = max_batch_tokens
        # This node's checkpoint files; ``storage`` (the checkpoints' root in --storage) keeps them where any
        # trainer reaches them, None: the directory itself.
        directory = checkpoint_dir or Path(tempfile.gettempdir()) / "lilo-checkpoints"
        self.checkpoints = CheckpointShelf(storage or Storage(directory), directory)
        self.base_model_name = base_model_name or str(getattr(model.config, "_name_or_path", ""))
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self.bank = LoraBank(self.model, max_adapters + sampler_slots, max_rank)
        self.layers = self.bank.layers
        # Whether training passes run packed (lilo.backend.training.packing): where the family's layers allow it and
        # ``pack`` asks for it (off: padded, as a reference for tests and benchmarks).
        self.packs = pack and self.bank.family.packs
        # Projections of the model no adapter reaches, per target: an adapter asking to train them is refused.
        self.uncovered = self.bank.uncovered(self.model)
        self.projections = self.bank.projections(self.model)
        self.decoder_layers = list(self.decoder.layers)
        # Sharded over a rank group (lilo.backend.sharding): ``peers`` is rank 0's line to the followers, None on
        # a follower; ``exchanged`` counts the bytes a follower received or sent, by kind, and the group's passes.
        self.sharded = sharded
        self.ranks = 1
        if sharded is not None:
            import torch.distributed as dist

            self.ranks = dist.get_world_size()
        self.peers: Peers | None = None
        self.exchanged: Counter[str] = Counter()
        self._stale: set[int] = set()  # slots whose adapter changed since the followers last saw it
        # A follower rank (lilo.backend.sharding) steps no optimizer, rank 0 does: it holds no Adam moments, which
        # on a GPU would take twice the bank's weights for nothing.
        self.optimizer = SlotAdamW(self.bank.weights, self.bank.grads) if optimizer else None
        self.dimuon = SlotDimuon(self.bank, self.optimizer) if optimizer else None
        # CUDA runs the LoRA deltas as torch's grouped GEMM; on CPU batched GEMMs over gathered rows are faster.
        self._grouped = self.device.type == "cuda"
        self.adapters: dict[str, Adapter] = {}
        # Sampler checkpoints held in slots (tinker path -> version loaded), least recently used first.
        self._samplers: OrderedDict[str, int] = OrderedDict()
        self._free_slots = list(range(max_adapters + sampler_slots))
        self.vocab_size = self.model.get_output_embeddings().base.out_features
        # Models beyond the slots wait paged out (lilo.backend.paging); 0 and 0: no paging, a full trainer says so.
        page_dir = page_dir or self.checkpoint_dir.parent / "pages"
        self.pages = PageStore(host_adapter_bytes, disk_adapter_bytes, page_dir, pin=self.device.type == "cuda",
                               mirror=PageMirror(page_storage, page_dir.parent) if page_storage else None)
        self._uses = 0
        self._last_used: dict[str, int] = {}  # training model -> when make_room or add_adapter last saw it
        self._grad_slots: set[int] = set()  # slots holding gradients an optim_step has not consumed yet
        self._entry_indices: dict[tuple, torch.Tensor] = {}
        # Models created for a restore whose load has not run yet (the trainer adds them, the load discards them):
        # their paged states are not restorable (``PagedState.restorable``).
        self.restoring: set[str] = set()

    # --- adapters ------------------------------------------------------------------------------------------
    def add_adapter(self, model_id: str, spec: LoraSpec) -> None:
        """A slot for ``model_id``: a training model (at most ``max_adapters`` of them), or a sampler checkpoint
        (a tinker path), which may also take the slots reserved for those."""
        if not 1 <= spec.rank <= self.max_rank:
            raise InvalidRequestError(f"LoRA rank {spec.rank} is out of range; use 1 to {self.max_rank}.")
        for target, asked in (("attn", spec.train_attn), ("mlp", spec.train_mlp)):
            if asked and self.uncovered[target]:
                family = getattr(self.model.config, "model_type", "this family")
                raise InvalidRequestError(
                    f"{self.base_model_name or 'This base model'} ({family}) has {target} projections lilo puts no "
                    f"adapter on ({', '.join(self.uncovered[target])}), so train_{target}=True would train fewer "
                    f"than asked; pass train_{target}=False to train the rest, or use a family lilo trains whole.")
        if not model_id.startswith(TINKER_SCHEME) and self.free_slots <= 0:
            raise SaturatedError(self._full_message())
        self._make_room()
        slot = self._free_slots.pop(0)
        generator = torch.Generator().manual_seed(spec.seed) if spec.seed is not None else None
        for path, layer in self.layers.items():
            if self.bank.trains(path, spec):
                layer.reset_slot(slot, spec.rank, spec.alpha or spec.rank, generator)
            else:
                layer.clear_slot(slot)
        self.optimizer.reset_slot(slot)
        self._grad_slots.discard(slot)
        self._stale.add(slot)
        self.adapters[model_id] = Adapter(slot, spec)
        if not model_id.startswith(TINKER_SCHEME):
            self._touch(model_id)

    def remove_adapter(self, model_id: str) -> None:
        self._last_used.pop(model_id, None)
        if model_id in self.pages:
            self.pages.drop(model_id)
            return
        adapter = self._adapter(model_id)
        self._grad_slots.discard(adapter.slot)
        for layer in self.layers.values():
            layer.clear_slot(adapter.slot)
        self.optimizer.zero_grad([adapter.slot])
        del self.adapters[model_id]
        self._samplers.pop(model_id, None)
        self._free_slots.append(adapter.slot)

    @property
    def free_slots(self) -> int:
        """Training models this trainer can still take (a cached sampler checkpoint gives its slot up to whoever
        needs one)."""
        return self.max_adapters - (len(self.adapters) - len(self._samplers))

    @property
    def room(self) -> int:
        """Training models this trainer can still take, in every tier (``room_by_tier``'s total)."""
        return self.room_by_tier().total

    def room_by_tier(self) -> Room:
        """Free slots, and as many models of the largest size (``max_rank``, every projection) as host memory and
        disk still hold paged out."""
        largest = 3 * self.bank.weights.shape[1] * self.bank.weights.element_size()
        host = max(0, self.pages.host_bytes - self.pages.host_used) // largest
        return Room(self.free_slots, host, max(0, self.pages.disk_bytes - self.pages.disk_used) // largest)

    def holds(self, model_id: str) -> bool:
        """Whether ``model_id`` is a training model here, in a slot or paged out."""
        return (model_id in self.adapters and model_id not in self._samplers) or model_id in self.pages

    # --- paging -------------------------------------------------------------------------------------------
    def training_slots(self) -> int:
        return self.max_adapters

    def pass_ranks(self) -> int:
        return self.ranks

    def slot_state_bytes(self) -> int:
        """Bytes of every slot's state together: LoRA weights, their gradients and both AdamW moments (none on a
        follower rank)."""
        return (4 if self.optimizer is not None else 2) * self.bank.weights.nbytes

    def make_room(self, model_ids: Sequence[str], running: Collection[str],
                  queued: Collection[str]) -> list[PageMove]:
        """Every one of ``model_ids`` that is paged out comes back into a slot, and for each not held at all (about
        to be added) a slot is freed: by paging out the resident models idle longest (``paging.choose_victims``),
        never one in ``running`` or ``model_ids``. Returns the moves, in order; ``SaturatedError`` when there is
        no room left in any tier."""
        moves: list[PageMove] = []
        for model_id in model_ids:
            if model_id in self.adapters:
                self._touch(model_id)
                continue
            state, tier = self.pages.take(model_id) if model_id in self.pages else (None, None)
            try:
                if self.free_slots <= 0:
                    moves += self._evict_one(set(running) | set(model_ids), queued)
            except SaturatedError:
                if state is not None:  # back where it was: the model is not lost for want of room
                    self.pages.put(model_id, state, self._last_used.get(model_id, 0))
                raise
            if state is not None:
                moves.append(self._page_in(model_id, state, tier))
        return moves

    def prefetch(self, model_ids: Sequence[str]) -> list[PageMove]:
        """Read the page files of those of ``model_ids`` waiting on disk into memory, so their page-ins need not
        (on the persist lane, while the compute lane runs: it touches no slot, only the page store)."""
        moves = []
        for model_id in model_ids:
            seconds = self.pages.stage(model_id)
            if seconds is not None:
                moves.append(PageMove(model_id, "in", "disk", seconds))
        return moves

    def _evict_one(self, keep: Collection[str], queued: Collection[str]) -> list[PageMove]:
        training = {model: used for model, used in self._last_used.items() if model in self.adapters}
        # The idlest whose state fits what the tiers have left (models differ in rank, so in size).
        for victim in choose_victims(training, len(training), keep, queued):
            if self.pages.room_for(self._state_bytes(victim)):
                return self._page_out(victim)
        raise SaturatedError(self._full_message())

    def _full_message(self) -> str:
        if not self.pages.host_bytes and not self.pages.disk_bytes:
            return (f"All {self.max_adapters} adapter slots of this trainer are in use; start lilo with more "
                    "--max-adapters, or give idle models room to page out with --host-adapter-mb or "
                    "--disk-adapter-gb.")
        return (f"All {self.max_adapters} adapter slots, {self.pages.host_bytes / 2**20:.0f} MB of host memory "
                f"and {self.pages.disk_bytes / 2**30:g} GB of disk for paged models on this trainer are full; "
                "raise --host-adapter-mb or --disk-adapter-gb (or --max-adapters), or unload models you no longer "
                "train.")

    def _touch(self, model_id: str) -> None:
        self._uses += 1
        self._last_used[model_id] = self._uses

    def _entry_index(self, spec: LoraSpec) -> torch.Tensor:
        """Where, in a slot's row of the bank, the entries an adapter of ``spec`` trains lie (all others are zero
        in its weights, moments and gradients, so they need not move)."""
        key = (spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed)
        index = self._entry_indices.get(key)
        if index is None:
            parts = [self.bank.trained_index(index, spec.rank) for n, path in enumerate(self.layers)
                     if self.bank.trains(path, spec) for index in (2 * n, 2 * n + 1)]
            index = self._entry_indices[key] = torch.cat(parts).to(self.device)
        return index

    def _state_bytes(self, model_id: str) -> int:
        adapter = self.adapters[model_id]
        rows = 4 if adapter.slot in self._grad_slots else 3
        return rows * self._entry_index(adapter.spec).numel() * self.bank.weights.element_size()

    def _page_out(self, model_id: str) -> list[PageMove]:
        started = time.perf_counter()
        adapter = self.adapters.pop(model_id)
        slot, has_grads = adapter.slot, adapter.slot in self._grad_slots
        flats = [self.bank.weights, self.optimizer.exp_avg, self.optimizer.exp_avg_sq]
        flats += [self.bank.grads] if has_grads else []
        data = torch.stack([flat[slot] for flat in flats]).index_select(1, self._entry_index(adapter.spec))
        if self.pages.pin:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            data = host.copy_(data)
        state = PagedState(adapter.spec, self.optimizer.steps(slot), has_grads, data,
                           restorable=model_id not in self.restoring)
        if has_grads:
            self.bank.grads[slot].zero_()
            self._grad_slots.discard(slot)
        self._free_slots.append(slot)
        demoted = self.pages.put(model_id, state, self._last_used[model_id])
        move = PageMove(model_id, "out", self.pages.tier_of(model_id), time.perf_counter() - started)
        return demoted + [move]

    def _page_in(self, model_id: str, state: PagedState, tier: Tier) -> PageMove:
        started = time.perf_counter()
        self._make_room()
        self._fill_slot(model_id, self._free_slots.pop(0), state)
        self._touch(model_id)
        return PageMove(model_id, "in", tier, time.perf_counter() - started)

    def _fill_slot(self, model_id: str, slot: int, state: PagedState) -> None:
        """``slot`` becomes ``model_id``'s, holding exactly ``state`` (weights, moments, step, gradients)."""
        index = self._entry_index(state.spec)
        data = state.data.to(self.device, non_blocking=True)
        flats = [self.bank.weights, self.optimizer.exp_avg, self.optimizer.exp_avg_sq, self.bank.grads]
        for k, flat in enumerate(flats):
            flat[slot].zero_()
            if k < len(data):
                flat[slot].index_copy_(0, index, data[k])
        if state.has_grads:
            self._grad_slots.add(slot)
        else:
            self._grad_slots.discard(slot)
        self.optimizer.set_steps(slot, state.step)
        self.set_slot_spec(slot, state.spec)
        self._stale.add(slot)
        self.adapters[model_id] = Adapter(slot, state.spec)

    def set_slot_spec(self, slot: int, spec: LoraSpec) -> None:
        """Tell every LoRA layer what rank and scale the adapter in ``slot`` has there (0: it does not train it)."""
        scale = (spec.alpha or spec.rank) / spec.rank
        for path, layer in self.layers.items():
            layer.set_adapter(slot, spec.rank if self.bank.trains(path, spec) else 0, scale)

    def _make_room(self, pinned: Container[str] = ()) -> None:
        """Free a slot if none is: evict the least recently used sampler checkpoint not in ``pinned``."""
        if self._free_slots:
            return
        evictable = next((key for key in self._samplers if key not in pinned), None)
        if evictable is None:
            raise SaturatedError(f"All {len(self.adapters)} adapter slots of this trainer hold training models or "
                                 "checkpoints this batch samples; start lilo with more --sampler-slots.")
        self.remove_adapter(evictable)

    def _adapter(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise NotFoundError(f"No adapter {model_id!r} on this trainer.")
        return adapter

    # --- training ------------------------------------------------------------------------------------------
    def forward_backward(self, commands: Sequence[Command[TrainInput]],
                         forward_only: bool) -> list[ForwardBackwardResult | Exception]:
        results: list[Any] = [None] * len(commands)
        valid: list[tuple[int, Command, losses.LossFn, dict]] = []
        for i, command in enumerate(commands):
            try:
                loss_fn, config = self._validate(command)
                valid.append((i, command, loss_fn, config))
            except Exception as error:  # this request alone fails; its batch mates go on
                results[i] = error
        if not valid:
            return results
        # One row per datum, tagged with its request; rows go through the model in micro-batches of at most
        # max_batch_tokens (a lone longer row runs with its layers recomputed), gradients accumulating across them.
        rows = [TrainRow(n, self.adapters[command.model_id].slot, datum, command.payload.loss_fn, config,
                         command.payload.custom_loss)
                for n, (_, command, _, config) in enumerate(valid) for datum in command.payload.data]
        slots = {row.slot for row in rows}
        pending = {} if forward_only else {slot: self.bank.grads[slot].clone() for slot in slots & self._grad_slots}
        outputs: list[list[dict]] = [[] for _ in valid]
        sums = [0.0] * len(valid)
        custom_metrics: list[dict[str, float]] = [{} for _ in valid]
        chunk: Sequence[TrainRow] = ()
        passes = self._passes(rows)
        try:
            if self.peers is not None:
                row_results = self._rows_on_group(passes, forward_only)
            else:
                row_results = []
                for (chunk,) in passes:
                    row_results += self._rows_pass(chunk, forward_only, self._recomputes(chunk, forward_only))
            # Results come back in the passes' order (rank by rank); each request's outputs go back in its datums'
            # order.
            ordered = (row for parts in passes for part in parts for row in part)
            by_row = {id(row): result for row, result in zip(ordered, row_results, strict=True)}
            for row in rows:
                logprobs, elementwise, loss, metrics = by_row[id(row)]
                output = {"logprobs": logprobs.tolist()}
                if elementwise is not None:  # a custom loss has none
                    output["elementwise_loss"] = elementwise.tolist()
                outputs[row.request].append(output)
                sums[row.request] += loss
                for key, value in metrics.items():
                    custom_metrics[row.request][key] = custom_metrics[row.request].get(key, 0.0) + value
        except Exception as error:
            if isinstance(error, UnavailableError) or not _out_of_memory(error):
                raise
            # Whatever the pass added to its models' gradients goes: each is as before the request.
            for slot in slots:
                if slot in pending:
                    self.bank.grads[slot].copy_(pending[slot])
                elif slot not in self._grad_slots:
                    self.bank.grads[slot].zero_()
            computed = self._pass_tokens(chunk)
            for i, command, _, _ in valid:
                results[i] = TooLargeError(
                    f"{command.kind} request {command.request_id} of model {command.model_id} ran out of this "
                    f"trainer's memory in a pass of {len(chunk)} sequence(s), {computed} computed tokens, and did not "
                    f"take effect ({str(error).splitlines()[0][:200]}). Send fewer or shorter datums per request, or "
                    "start lilo with a smaller --max-batch-tokens (or a larger --trainer-memory-gb).")
            return results
        if not forward_only:
            self._grad_slots.update(slots)
        for n, (i, command, _, _) in enumerate(valid):
            reduced = {key: value / len(command.payload.data) if key.endswith(":mean") else value
                       for key, value in custom_metrics[n].items()}
            results[i] = {"loss_fn_outputs": outputs[n], "metrics": {**reduced, "loss:sum": sums[n]}}
        return results

    def _passes(self, rows: Sequence[TrainRow]) -> list[list[list[TrainRow]]]:
        """The passes ``rows`` take, each as one part per rank, every part within the budget (but a lone longer
        row). Packed: parts filled by real tokens (``packing.packed_bins``); padded: micro-batches of rows of like
        lengths (``_micro_batches``), a sharded trainer's split over its ranks."""
        if not self._packs(rows):
            return [_split(batch, self.ranks) for batch in _micro_batches(rows, self.max_batch_tokens * self.ranks)]
        bins = [[rows[i] for i in indices] for indices in
                packing.packed_bins([len(row.datum.tokens) for row in rows], self.max_batch_tokens)]
        # Each part's rows by slot, so each adapter's tokens run as one stretch of the stream.
        parts = [sorted(part, key=lambda row: row.slot) for part in bins]
        parts += [[]] * (-len(parts) % self.ranks)
        return [parts[i:i + self.ranks] for i in range(0, len(parts), self.ranks)]

    def _pass_tokens(self, rows: Sequence[TrainRow]) -> int:
        """The tokens a pass of ``rows`` computes: theirs packed, rows x longest padded."""
        return sum(len(row.datum.tokens) for row in rows) if self._packs(rows) else _padded_size(rows)

    def _packs(self, rows: Sequence[TrainRow]) -> bool:
        """Whether a pass of ``rows`` runs packed: where the model packs, and takes the images of any row that holds
        some (a model without a layout refuses them in a padded pass)."""
        return self.packs and (self.images is not None or not any(row.datum.images for row in rows))

    def _recomputes(self, rows: Sequence[TrainRow], forward_only: bool) -> bool:
        """Whether a pass of ``rows`` recomputes its layers in the backward: a lone row longer than the budget."""
        return not forward_only and self._pass_tokens(rows) > self.max_batch_tokens

    def _rows_pass(self, rows: Sequence[TrainRow], forward_only: bool,
                   recompute: bool) -> list[RowResult]:
        """(target logprobs, per-token loss (None for a custom loss), loss sum, a custom loss's metrics) of each
        row, its gradients accumulated into the rows' slots unless ``forward_only``. The rows stay routed through
        the backward pass, which recomputes the log-probabilities' slices (and with ``recompute`` every decoder
        layer). On a sharded base a rank with no rows runs an idle one, as it must take part in the pass's
        collectives."""
        batch = list(rows) or [_IDLE_ROW]
        packed = self._packs(batch)
        self._route([row.slot for row in batch], [len(row.datum.tokens) for row in batch] if packed else None)
        try:
            with (torch.set_grad_enabled(not forward_only), recomputed_layers(self.decoder_layers, recompute),
                  self._embeddings_as_leaf(self.sharded is not None and not forward_only)):
                hidden, row_positions = self._packed_hidden(batch) if packed else self._padded_hidden(batch)
                targets = [row.datum.loss_inputs["target_tokens"] for row in batch]
                targets = (packing.packed_targets(targets) if packed else _padded_targets(targets)).to(self.device)
                target_logprobs = token_logprobs.target_logprobs(hidden, self.model.get_output_embeddings(), targets)
                per_row = []
                for (index, start), row in zip(row_positions, batch):
                    logprobs = _datum_logprobs(target_logprobs[index, start:], row.datum)
                    inputs = {key: torch.tensor(np.asarray(value), dtype=torch.float32, device=self.device)
                              for key, value in row.datum.loss_inputs.items() if key != "target_tokens"}
                    elementwise, loss, metrics = losses.datum_loss(row.loss_fn, row.config, row.custom_loss, logprobs,
                                                                   inputs)
                    per_row.append((logprobs.detach(), None if elementwise is None else elementwise.detach(), loss,
                                    {key: float(value.detach()) for key, value in metrics.items()}))
                if not forward_only:
                    torch.stack([loss for _, _, loss, _ in per_row]).sum().backward()
        finally:
            self._route(None)
        return [(logprobs, elementwise, float(loss.detach()), metrics)
                for logprobs, elementwise, loss, metrics in per_row[:len(rows)]]

    def _padded_hidden(self, batch: Sequence[TrainRow]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The last hidden states of ``batch`` as right-padded rows, and where each row's tokens start in them (its
        index, 0)."""
        input_ids, mask = (t.to(self.device) for t in _padded([row.datum.tokens for row in batch]))
        images = [image for row in batch for image in row.datum.images]
        # Without padding the mask adds nothing, and leaving it out keeps attention on its fast causal path. No KV
        # cache: a training pass never decodes further, and the model's default builds one.
        attention_mask = None if bool(mask.all()) else mask
        if images:
            hidden = self._multimodal_hidden(input_ids, attention_mask, images)
        else:
            hidden = self.decoder(input_ids=input_ids, use_cache=False, attention_mask=attention_mask).last_hidden_state
        return hidden, [(index, 0) for index in range(len(batch))]

    def _packed_hidden(self, batch: Sequence[TrainRow]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The last hidden states of ``batch`` packed end to end in one row (``lilo.backend.training.packing``),
        and where each row's tokens start in it (0, its offset)."""
        input_ids, positions, segments = packing.packed_stream([row.datum.tokens for row in batch])
        input_ids = input_ids.to(self.device)
        images = [image for row in batch for image in row.datum.images]
        family = self.bank.family
        with packing.packed_attention(self.decoder, family.recurrent, family.packed_mask):
            if images:
                hidden = self._multimodal_hidden(input_ids, None, images, segments,
                                                 [len(row.datum.images) for row in batch], positions.to(self.device))
            else:
                hidden = self.decoder(input_ids=input_ids, position_ids=positions.to(self.device), use_cache=False,
                                      **{packing.SEGMENTS: segments}).last_hidden_state
        return hidden, [(0, start) for start, _ in segments]

    def _multimodal_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           images: Sequence[DatumImage], segments: Sequence[tuple[int, int]] | None = None,
                           images_per_row: Sequence[int] = (), positions: torch.Tensor | None = None,
                           ) -> torch.Tensor:
        """The last hidden states of a pass whose rows hold ``images`` (in row order): through the multimodal model,
        the image features (the frozen vision tower's, no gradient) in place of their tokens' embeddings, positions
        from the model's own multimodal rotary index where it has one, else ``positions`` (the text pass's). With
        ``segments``, one packed row of them (each holding ``images_per_row`` of the images)."""
        if self.multimodal is None:  # it has no image layout
            raise InvalidRequestError(f"Base model {self.base_model_name!r} takes no images; send text only.")
        inputs = multimodal_inputs(self.multimodal, self.images, input_ids, attention_mask, images, segments,
                                   images_per_row, positions)
        packed = {packing.SEGMENTS: segments} if segments is not None else {}
        return self.multimodal(**inputs, attention_mask=attention_mask, use_cache=False, **packed).last_hidden_state

    @contextlib.contextmanager
    def _embeddings_as_leaf(self, wanted: bool) -> Iterator[None]:
        """With ``wanted``, the embeddings' output a leaf that wants its gradient: every rank's backward then runs
        through every layer, whichever projections its rows' adapters train, so FSDP's gathers there come in the
        same order on all. A hook, not ``inputs_embeds``: some families' layers read the token ids too
        (DeepSeek-V4's hash routing, Gemma 4's per-layer inputs)."""
        if not wanted:
            yield
            return
        handle = self.decoder.get_input_embeddings().register_forward_hook(
            lambda module, args, output: output.detach().requires_grad_())
        try:
            yield
        finally:
            handle.remove()

    # --- the rank group (lilo.backend.sharding) -------------------------------------------------------------
    def _rows_on_group(self, chunks: Sequence[Sequence[Sequence[TrainRow]]],
                       forward_only: bool) -> list[RowResult]:
        """``_rows_pass`` over the group: each pass's parts one a rank, rank 0 running the first; the followers'
        gradients summed into rank 0's after the last. Returns every row's result, in the passes' order."""
        rows = [row for parts in chunks for part in parts for row in part]
        recompute = [any(self._recomputes(part, forward_only) for part in parts) for parts in chunks]
        specs = self._slot_specs()
        trained = () if forward_only else sorted({row.slot for row in rows})
        grad_slots = tuple(SlotUpdate(slot, specs[slot]) for slot in trained)
        updates = self._updates({row.slot for row in rows})
        plans = [TrainPlan(updates, tuple((tuple(parts[rank]), again) for parts, again in zip(chunks, recompute)),
                           forward_only, grad_slots) for rank in range(1, self.ranks)]

        def own() -> list[list[tuple[torch.Tensor, torch.Tensor, float]]]:
            self.exchanged["weights"] += broadcast_slots(self.bank.weights, updates, self._entry_index)
            results = [self._rows_pass(parts[0], forward_only, again) for parts, again in zip(chunks, recompute)]
            self.exchanged["gradients"] += sum_gradients(self.bank.grads, grad_slots, self._entry_index)
            self.exchanged["gathered"] += len(chunks) * self.sharded.gathered_per_pass(backward=not forward_only)
            return results

        mine, theirs = self._on_group(plans, own)
        ordered = []
        for index, results in enumerate(mine):
            ordered += results
            for follower in theirs:
                ordered += follower[index]
        return ordered

    def _generate_on_group(self, requests: list[SamplingRequest], slots: list[int]) -> list[SampleResult]:
        """One generation on every rank of the group at once: each request's seed drawn here when it has none, so
        every rank samples the same tokens (and stops when the others do)."""
        requests = [request if request.seed is not None else dataclasses.replace(request, seed=random.getrandbits(62))
                    for request in requests]
        updates = self._updates({slot for slot in slots if slot != BASE_SLOT})
        plan = SamplePlan(updates, tuple(requests), tuple(slots))

        def own() -> list[SampleResult]:
            self.exchanged["weights"] += broadcast_slots(self.bank.weights, updates, self._entry_index)
            return sampling.generate(self.model, self._route_sampling, requests, slots, self.decode,
                                     self.images)

        return self._on_group([plan] * (self.ranks - 1), own)[0]

    def _on_group(self, plans: Sequence[Plan], own: Any) -> tuple[Any, list[Any]]:
        """``own()`` here while the followers run their ``plans``; (its result, theirs). A failure on any rank
        leaves the group's collectives out of step: the group is rebuilt, and the pass fails with a message."""
        pending = self.peers.dispatch(plans)
        try:
            mine = own()
            theirs = self.peers.collect(pending)
        except Exception as error:
            self.peers.failed(error)
            raise UnavailableError(
                f"A pass on this trainer's {self.ranks} ranks failed ({str(error).splitlines()[0][:300]}), so it did "
                "not take effect. The trainer restarts its rank group and restores its models from their latest "
                "checkpoint or page file; send your next request in a few seconds.") from error
        self.exchanged["passes"] += 1
        return mine, theirs

    def _slot_specs(self) -> dict[int, LoraSpec]:
        return {adapter.slot: adapter.spec for adapter in self.adapters.values()}

    def _updates(self, slots: Collection[int]) -> tuple[SlotUpdate, ...]:
        """The adapters of ``slots`` the followers have not seen as they are now (they will have after the pass)."""
        specs = self._slot_specs()
        changed = sorted(set(slots) & self._stale)
        self._stale.difference_update(changed)
        return tuple(SlotUpdate(slot, specs[slot]) for slot in changed)

    def longest_datum(self) -> int:
        """The most tokens one datum may have here: a row longer than the budget runs alone, its layers recomputed
        (``batch_tokens.longest_sequence``)."""
        dtype_bytes = next(self.model.parameters()).element_size()
        return batch_tokens.longest_sequence(self.model.config.get_text_config(), dtype_bytes, self.max_batch_tokens)

    def check_fits(self, train: TrainInput) -> None:
        """Refuse (413) a request with a datum no pass of this trainer can hold, before anything of it runs."""
        longest = self.longest_datum()
        for index, datum in enumerate(train.data):
            if len(datum.tokens) > longest:
                raise TooLargeError(
                    f"Datum {index} has {len(datum.tokens)} tokens, and a pass on this trainer holds at most {longest} "
                    f"tokens of one sequence ({self.max_batch_tokens} per pass, more for a lone sequence whose layers "
                    "are recomputed); split it into shorter datums, or serve the model on a device with more memory "
                    "(--max-batch-tokens sizes the passes)."
                    + (f" This trainer's {self.ranks} ranks each run whole sequences: lilo does not split one over "
                       "ranks (no context parallelism) yet." if self.ranks > 1 else ""))

    def _validate(self, command: Command) -> tuple[losses.LossFn, dict]:
        self._adapter(command.model_id)
        config = check_train_input(command.payload, self.vocab_size)
        self.check_fits(command.payload)
        if command.payload.custom_loss is not None:
            losses.check_custom_loss(command.payload.custom_loss, command.payload.data)
        return losses.LOSSES.get(command.payload.loss_fn), config

    def _route(self, slots: Sequence[int] | None, lengths: Sequence[int] | None = None) -> None:
        """Tell every LoRA layer which slot each row uses (``BASE_SLOT``: none); with ``lengths``, of rows packed
        end to end."""
        self.bank.route(slots, GROUPED if self._grouped else BATCHED, lengths)

    def _route_sampling(self, slots: Sequence[int] | None) -> None:
        """The same for a generation: no autograd, so on the CPU one GEMM per run of rows at its adapter's rank."""
        self.bank.route(slots, GROUPED if self._grouped else RUNS)

    def optim_step(self, commands: Sequence[Command[AdamParams | DimuonParams]]) -> list[OptimStepResult | Exception]:
        """One step of every command's model, with the optimizer family it was created with (its spec's): AdamW's
        fused over their slots, Dimuon's batched by rank; a step whose settings are another family's fails alone."""
        results: list[Any] = [None] * len(commands)
        families: dict[str, list[int]] = {}
        for i, command in enumerate(commands):
            try:
                family = self._adapter(command.model_id).spec.optimizer
                if not isinstance(command.payload, OPTIMIZERS[family]):
                    raise InvalidRequestError(
                        f"Model {command.model_id!r} trains with {family} (its optimizer_config at creation); send "
                        f"{OPTIMIZERS[family].__name__} to its optim_step, not {type(command.payload).__name__}.")
                families.setdefault(family, []).append(i)
            except Exception as error:  # this request alone fails
                results[i] = error
        for family, members in families.items():
            adapters = [self.adapters[commands[i].model_id] for i in members]
            slots, params = [a.slot for a in adapters], [commands[i].payload for i in members]
            norms = (self.optimizer.step(slots, params) if family == "adamw"
                     else self.dimuon.step(slots, [a.spec for a in adapters], params))
            self._stale.update(slots)
            self.optimizer.zero_grad(slots)
            self._grad_slots.difference_update(slots)
            for i, norm in zip(members, norms):
                results[i] = {"metrics": {"grad_norm:mean": norm}}
        return results

    def sample(self, commands: Sequence[Command[SamplingRequest]],
               cancelled: Callable[[str], bool] = frozenset().__contains__) -> list[SampleResult | Exception]:
        """Every command's samples, each row through its own adapter (``model_id``: a training model, or a sampler
        checkpoint's tinker path) or none (``base_only``): in one batched generation, or in several when the batch
        samples more checkpoints than there are slots to hold them at once. A command ``cancelled`` names (by
        request id) stops at its next token, on one rank (a group's ranks must stop together: they run on)."""
        results: list[Any] = [None] * len(commands)
        waiting = list(range(len(commands)))
        while waiting:
            valid, slots, deferred = [], [], []
            pinned: set[str] = set()  # the checkpoints this generation samples: none of them may be evicted
            for i in waiting:
                try:
                    request: SamplingRequest = commands[i].payload
                    slot = BASE_SLOT if request.base_only else self._sampling_slot(commands[i].model_id, pinned)
                    sampling.validate(request, self.vocab_size, self.decode)
                    if request.images and self.images is None:
                        raise InvalidRequestError(f"Base model {self.base_model_name!r} takes no images; send text "
                                                  "only.")
                    valid.append(i)
                    slots.append(slot)
                except SaturatedError as error:
                    if pinned:  # every slot it could take holds a checkpoint this generation samples
                        deferred.append(i)
                    else:
                        results[i] = error
                except Exception as error:
                    results[i] = error
            if valid:
                requests = [commands[i].payload for i in valid]
                if self.peers is not None:
                    generated = self._generate_on_group(requests, slots)
                else:
                    ids = [commands[i].request_id for i in valid]
                    generated = sampling.generate(
                        self.model, self._route_sampling, requests, slots, self.decode, self.images,
                        lambda j, ids=ids: cancelled(ids[j]), between_tokens=lambda: self._refresh_samplers(pinned))
                for i, result in zip(valid, generated):
                    results[i] = result
            waiting = deferred
        return results

    # --- checkpoints ---------------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        """This node's checkpoint directory: its copies, or with the default storage the checkpoints themselves."""
        return self.checkpoints.local

    @checkpoint_dir.setter
    def checkpoint_dir(self, directory: Path) -> None:
        """Keep checkpoints in ``directory`` itself (the default storage)."""
        self.checkpoints = CheckpointShelf(Storage(directory), directory)

    def _slices(self, adapter: Adapter):
        """(key, A or B parameter index, slice of the slot) of every projection the adapter trains."""
        rank = adapter.spec.rank
        for n, path in enumerate(self.layers):
            if self.bank.trains(path, adapter.spec):
                # A's first rows, B's first columns (of every expert, for fused experts).
                yield f"{path}.lora_A", 2 * n, (adapter.slot, Ellipsis, slice(0, rank), slice(None))
                yield f"{path}.lora_B", 2 * n + 1, (adapter.slot, Ellipsis, slice(0, rank))

    def capture_checkpoint(self, command: Command[SaveRequest]) -> tuple[str, AdapterState]:
        """Copy the adapter (and for save_weights its optimizer state) to CPU; the slot may change right after."""
        name = checked_name(command.payload.name)
        return name, self._state_of(self._adapter(command.model_id), with_optimizer=command.kind == Kind.SAVE_WEIGHTS)

    def _state_of(self, adapter: Adapter, with_optimizer: bool) -> AdapterState:
        sources = {"": self.bank.weights}
        if with_optimizer:
            sources.update({".exp_avg": self.optimizer.exp_avg, ".exp_avg_sq": self.optimizer.exp_avg_sq})
        step = self.optimizer.steps(adapter.slot) if with_optimizer else None
        return AdapterState(adapter.spec, self._tensors_of(adapter, sources), step, captured_at=time.time())

    def _tensors_of(self, adapter: Adapter, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per projection the adapter trains, its A and B (``<path>.lora_A`` + suffix) in each of ``sources``
        (flat (slots, D) tensors: the weights, the moments), copied to the CPU."""
        tensors = {}
        for key, index, where in self._slices(adapter):
            for suffix, flat in sources.items():
                tensors[key + suffix] = self.bank.view(flat, index)[where].to("cpu", copy=True)
        return tensors

    def _state_of_paged(self, state: PagedState) -> AdapterState:
        """What ``_state_of`` (with the optimizer) would capture of ``state`` back in a slot, without a slot: its
        entries scattered into one CPU row per flat tensor (a paged model is saved where it waits)."""
        rows = torch.zeros(3, 1, self.bank.weights.shape[1], dtype=self.bank.weights.dtype)
        rows[:, 0].index_copy_(1, self._entry_index(state.spec).cpu(), state.data[:3].to(rows.dtype))
        tensors = self._tensors_of(Adapter(0, state.spec), dict(zip(("", ".exp_avg", ".exp_avg_sq"), rows)))
        return AdapterState(state.spec, tensors, state.step, captured_at=state.paged_at)

    def persist_checkpoint(self, command: Command[SaveRequest], captured: tuple[str, AdapterState]) -> SaveResult:
        """Write the captured adapter, on this node and then in the storage; returns its ``tinker://`` path."""
        name, state = captured
        path = tinker_path(command.model_id, command.kind, name)
        with self.checkpoints.writing(path) as directory:
            if command.kind == Kind.SAVE_WEIGHTS:
                write_state(state, directory)
            else:
                write_peft(state, directory, self.base_model_name)
        if command.payload.sampling_session_id:
            return {"path": path, "sampling_session_id": command.payload.sampling_session_id}
        return {"path": path}

    def save_now(self, model_id: str, name: str) -> str:
        """Capture and write ``model_id``'s adapter and optimizer state as the save_weights checkpoint ``name``
        at once, outside any engine (a trainer saving its models as it stops); returns its tinker path."""
        command = Command(model_id, 0, Kind.SAVE_WEIGHTS, f"save-{model_id}", payload=SaveRequest(name=name))
        if model_id in self.pages:  # saved from its paged state, where it waits: no slot for it, no page-in
            captured = (checked_name(name), self._state_of_paged(self.pages.peek(model_id)))
        else:
            captured = self.capture_checkpoint(command)
        return self.persist_checkpoint(command, captured)["path"]

    def load_checkpoint(self, command: Command[LoadRequest]) -> LoadResult:
        """Restore an adapter (and its optimizer state, unless ``optimizer=False``) saved by save_weights. A load
        that fails part-way (a rank over this trainer's maximum, tensors of another base model) leaves the model
        as it was."""
        try:
            if isinstance(command.payload, PageRestore):
                return self._restore_paged(command.model_id, command.payload)
            return self._load_checkpoint(command)
        finally:  # loaded or not, what the model holds from now on is its state
            self.restoring.discard(command.model_id)

    def _load_checkpoint(self, command: Command[LoadRequest]) -> LoadResult:
        request: LoadRequest = command.payload
        state = read_state(self.checkpoints.fetched(request.path))
        current = self._adapter(command.model_id)
        if not request.optimizer:  # the weights alone: the model keeps training with its own optimizer family
            state = dataclasses.replace(state, spec=dataclasses.replace(state.spec, optimizer=current.spec.optimizer))
        before = self._state_of(current, with_optimizer=True)
        try:
            self._install(command.model_id, state, optimizer=request.optimizer)
        except Exception:
            self._install(command.model_id, before, optimizer=True)
            raise
        return {"path": request.path}

    def _restore_paged(self, model_id: str, restore: PageRestore) -> LoadResult:
        """``model_id`` (just created) takes the state of its page file, and its page files go: here, on the
        compute lane, so that none is deleted after this trainer pages the model out again to the same path."""
        if not 1 <= restore.state.spec.rank <= self.max_rank:
            raise InvalidRequestError(f"The page file's LoRA rank {restore.state.spec.rank} does not fit this "
                                      f"trainer's --max-rank {self.max_rank}.")
        self._fill_slot(model_id, self._adapter(model_id).slot, restore.state)
        for path in restore.files:
            self.pages.unlink(path)
        return {"path": str(restore.files[0])}

    def _install(self, model_id: str, state: AdapterState, optimizer: bool) -> None:
        """``model_id``'s adapter becomes ``state``'s, with its optimizer state when ``optimizer`` and it has one
        (else fresh)."""
        if model_id in self.adapters:  # not after a failed install that it undoes
            self.remove_adapter(model_id)
        self.add_adapter(model_id, state.spec)
        adapter = self.adapters[model_id]
        with_optimizer = optimizer and state.step is not None
        targets = {"": self.bank.weights}
        if with_optimizer:
            targets.update({".exp_avg": self.optimizer.exp_avg, ".exp_avg_sq": self.optimizer.exp_avg_sq})
        self._write_tensors(adapter, state, targets)
        if with_optimizer:
            self.optimizer.set_steps(adapter.slot, state.step)

    def _write_tensors(self, adapter: Adapter, state: AdapterState, targets: dict[str, torch.Tensor]) -> None:
        """``state``'s tensors into ``adapter``'s slot: each ``<key><suffix>`` into the flat tensor ``targets``
        maps the suffix to."""
        for key, index, where in self._slices(adapter):
            for suffix, flat in targets.items():
                self.bank.view(flat, index)[where] = state.tensors[key + suffix].to(flat.device, flat.dtype)

    # --- sampler checkpoints -------------------------------------------------------------------------------
    def sampler_version(self, path: str, fetch: bool = True) -> int:
        """When this node's copy of the sampler checkpoint ``path`` was last written whole (its marker file, written
        last: a save under the same name again replaces it); with ``fetch``, the copy is first brought up to the
        storage's (``CheckpointShelf.fetched``)."""
        try:
            directory = self.checkpoints.fetched(path) if fetch else self.checkpoints.directory(path)
            return (directory / PEFT_CONFIG).stat().st_mtime_ns
        except FileNotFoundError:
            raise NotFoundError(
                f"No sampler checkpoint {path!r} here; pass a path save_weights_for_sampler returned.") from None

    def _sampling_slot(self, key: str, pinned: set[str]) -> int:
        """The slot of ``key``'s adapter: a training model's, or a sampler checkpoint's (a tinker path), which goes
        into a slot on first use, evicting the least recently used other checkpoint not in ``pinned`` (those this
        batch samples) when every slot is taken, and stays there while slots allow."""
        if key.startswith(TINKER_SCHEME) and key not in pinned:  # each checkpoint's version read once per batch
            self._load_sampler(key, pinned)
            pinned.add(key)
        return self._adapter(key).slot

    def _refresh_samplers(self, paths: Collection[str]) -> None:
        """Sampler checkpoints saved again since they were loaded (a model's inflight checkpoint, which each of its
        inflight saves writes again): their new weights go into the slots they hold, so the rows of a generation
        under way that sample them continue on them from their next token. A checkpoint being written stays as it
        is until its marker says it is whole."""
        for path in paths:
            try:
                version = self.sampler_version(path, fetch=False)
            except NotFoundError:
                continue
            if self._samplers.get(path) == version:
                continue
            state = read_peft(self.checkpoints.directory(path))
            adapter = self.adapters[path]
            if state.spec.rank != adapter.spec.rank:  # not the same model's weights: the next generation reloads
                continue
            self._write_tensors(adapter, state, {"": self.bank.weights})
            self._stale.add(adapter.slot)
            self._samplers[path] = version

    def _load_sampler(self, path: str, pinned: Container[str]) -> None:
        try:
            version = self.sampler_version(path)
        except NotFoundError:
            if path not in self._samplers or not self.checkpoints.directory(path).is_dir():
                raise
            # Being saved again under its name: the copy in place is its latest whole version.
            version = self._samplers[path]
        if self._samplers.get(path) != version:
            if path in self.adapters:
                self.remove_adapter(path)
            self._make_room(pinned)
            try:
                self._install(path, read_peft(self.checkpoints.directory(path)), optimizer=False)
            except (KeyError, RuntimeError) as error:  # tensors of another model: the slot is not kept (nor counted)
                self.remove_adapter(path)
                raise InvalidRequestError(
                    f"The sampler checkpoint {path!r} does not fit the base model {self.base_model_name!r} ({error}); "
                    "sample it on the base model it was trained on.") from error
            self._samplers[path] = version
        self._samplers.move_to_end(path)


def _micro_batches(rows: Sequence[TrainRow], max_tokens: int) -> list[list[TrainRow]]:
    """``rows`` grouped so each group's padded size (rows x longest) stays within ``max_tokens``: filled longest
    first, so rows of like lengths share a group and pad each other little (in arrival order an RL-shaped pass
    computed 35-62 % real tokens; bench_padding.py), and within a group by adapter slot, so each adapter's rows sit
    side by side for its LoRA GEMM (a stable sort: a request keeps its datum order)."""
    batches: list[list[TrainRow]] = []
    current: list[TrainRow] = []
    longest = 0
    for row in sorted(rows, key=lambda row: -len(row.datum.tokens)):
        length = len(row.datum.tokens)
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return [sorted(batch, key=lambda row: row.slot) for batch in batches]


def _split(rows: Sequence[TrainRow], parts: int) -> list[list[TrainRow]]:
    """``rows`` in ``parts`` consecutive parts of as equal a count as can be (the first ones longer; some may be
    empty)."""
    size, extra = divmod(len(rows), parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (part < extra))
    return [list(rows[a:b]) for a, b in zip(bounds, bounds[1:])]


def _padded_size(rows: Sequence[TrainRow]) -> int:
    return len(rows) * max((len(row.datum.tokens) for row in rows), default=0)


# What a rank with no rows in a micro-batch runs: one token, through no adapter, of zero loss.
# What a pass gives each row: (target logprobs, per-token loss or None, loss, custom metrics).
RowResult = tuple[torch.Tensor, torch.Tensor | None, float, dict[str, float]]
_IDLE_ROW = TrainRow(-1, BASE_SLOT, Datum(tokens=[0], loss_inputs={"target_tokens": [0], "weights": [0.0]}),
                     "cross_entropy", {})


def _padded(sequences: Sequence[Sequence[int] | np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention mask) for ragged token lists."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.as_tensor(np.asarray(sequence, dtype=np.int64))
        mask[row, :len(sequence)] = 1
    return ids, mask


def _padded_targets(targets: Sequence[Sequence[int] | np.ndarray]) -> torch.Tensor:
    """(rows, longest, K) target ids, K the most any row has per position (1 for one target a token), zero-padded."""
    arrays = [np.asarray(t, dtype=np.int64).reshape(len(t), -1) for t in targets]
    out = torch.zeros(len(arrays), max(len(a) for a in arrays), max(a.shape[1] for a in arrays), dtype=torch.long)
    for row, array in enumerate(arrays):
        out[row, :array.shape[0], :array.shape[1]] = torch.from_numpy(array)
    return out


def _datum_logprobs(row_logprobs: torch.Tensor, datum: Datum) -> torch.Tensor:
    """The datum's own part of the (positions, K) log-probabilities from its first token on: (tokens,) or, for
    top-K targets, (tokens, K)."""
    targets = np.shape(datum.loss_inputs["target_tokens"])
    logprobs = row_logprobs[:targets[0], :(targets[1] if len(targets) == 2 else 1)]
    return logprobs if len(targets) == 2 else logprobs[:, 0]


def _out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: the GPU's, or the CPU's under the trainer's memory cap."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(error)
