"""One typed settings object for a lilo service, built once at start and passed down.

Precedence: defaults < environment (``LILO_*``) < explicit overrides (command-line flags).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

from lilo.api_keys import ApiKeyConfigError, load_key_digests
from lilo.backend.registry import DEFAULT_BASE_MODEL, MODEL_PATHS_ENV, is_servable, unservable_message
from lilo.futures.paths import default_db_path, is_ledger_url
from lilo.tenant_policy import TenantsFileError, read_tenants_file

# Ray puts unix sockets under <temp dir>/session_<timestamp>_<pid>/sockets/..., and a unix socket path may not
# exceed 107 bytes; this leaves room for Ray's own part of the path.
MAX_RAY_TEMP_DIR_CHARS = 40


COMPRESS_BODIES = ("auto", "always", "never")


class SettingsError(ValueError):
    """A setting a user can fix; the message says how."""


def default_home() -> Path:
    return Path.home() / ".lilo"


@dataclasses.dataclass(frozen=True)
class Settings:
    home: Path = dataclasses.field(default_factory=default_home)
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    dashboard_port: int = 8265
    # None: every CPU of this machine.
    num_cpus: int | None = None
    base_models: tuple[str, ...] = (DEFAULT_BASE_MODEL,)
    # Base models served under a name of their own from a local directory (--base-model NAME=PATH): (name, path).
    model_paths: tuple[tuple[str, str], ...] = ()
    # Trainer actors: None means one per GPU, or one on a machine without GPUs.
    trainers: int | None = None
    # Adapter slots per trainer: how many training models one trainer holds at once.
    max_adapters: int = 16
    # Devices (processes on CPU) per trainer, the base model sharded over them (lilo.backend.sharding): "N" for
    # every base model, with "MODEL=N" overrides after it, comma-separated ("1,big/model=4").
    trainer_ranks: str = "1"
    # The largest LoRA rank a model may have on a trainer: every adapter slot holds this rank's weights, gradients
    # and optimizer moments from the start, so memory grows with it as with the slots. A model of a larger rank is
    # refused, with a message naming this maximum.
    max_rank: int = 32
    # Further slots per trainer that only sampler checkpoints use (they also use free training slots): sampling
    # a saved checkpoint works while training models fill every training slot.
    sampler_slots: int = 2
    # vLLM sampler actors (cluster.sampling.plane): 0 none, the trainers' torch samplers answer every sample; a
    # fraction F < 1: one sampler beside each trainer on a share F of its GPU; a whole number N: N per base model,
    # a GPU each. The trainers relay to them the samples they answer exactly; the torch sampler answers the rest.
    samplers: float = 0.0
    # The adapters a vLLM sampler holds loaded at once (its LoRA slots); the least recently used gives way.
    sampler_max_loras: int = 8
    # Padded tokens one forward/backward pass holds: commands of several models coalesce into a pass up to this, and
    # a larger request runs as micro-batches of at most this. None: sized by each trainer from its device's free
    # memory and its base model (lilo.backend.training.batch_tokens).
    max_batch_tokens: int | None = None
    # The longest a pass that could start waits for the next commands of models stepping in rhythm with it
    # (lilo.engine.window; also never more than a quarter of the pass). 0: no window, every pass starts at once.
    coalesce_window_ms: float = 100.0
    # The most memory (GB) a trainer process may take (its data: model, adapter slots, passes); past it an
    # allocation fails and the pass that asked fails with a message, instead of the node running out and Ray
    # killing processes. None: CPU trainers a share of their node's memory (backend.training.memory_cap), GPU trainers
    # none; 0: no cap.
    trainer_memory_gb: float | None = None
    # Where a trainer's models beyond its slots wait, whole (weights, optimizer state, step): host memory, MB per
    # trainer (None: a sixteenth of its node's memory; pinned under CUDA), then disk under the home, GB per trainer.
    # A model comes back into a slot before its next command; create_model is refused only when all are full.
    host_adapter_mb: int | None = None
    disk_adapter_gb: float = 16.0
    # Address of an existing Ray cluster to deploy onto ("auto" on a `ray up` head); None starts a private head.
    ray_address: str | None = None
    startup_timeout_s: float = 120.0
    # Where trainers compute: "auto" (CUDA when the trainer has a GPU, else CPU), "cpu" or "cuda".
    device: str = "auto"
    # Largest request body the API accepts (a larger one is a 413); zstd bodies may not inflate past it either.
    max_body_mb: int = 64
    # Whether the SDK zstd-compresses forward_backward bodies (client/config's proto_compress_fwdbwd): "auto" asks
    # it of clients on other machines only (on the same machine it costs both ends CPU and saves nothing), "always"
    # or "never".
    compress_bodies: str = "auto"
    # How much nicer than the rest of its process each trainer's compute thread (and the torch threads it starts)
    # runs: batched steps yield the CPU to the latency-bound control plane (HTTP proxy, ingress, futures DB), so a
    # heartbeat or a submission does not queue behind a training step. 0 leaves the compute thread as it is.
    compute_nice: int = 10
    # A session that sends no heartbeat for this long (its client died without closing; the SDK beats every 10 s)
    # has its models unloaded, as closing the client would, so their adapter slots are not taken forever. 0: never.
    session_timeout_s: float = 3600.0
    # How long the trainers may take, when the service stops, to save every model they hold (the checkpoint
    # ``lilo-shutdown``, from which the next start resumes them); ``lilo down`` waits this plus a margin. 0: no save.
    stop_save_timeout_s: float = 40.0
    # API keys (see lilo.api_keys): comma-separated ``tml-key[=tenant]`` entries (only from the environment, never
    # a flag, which any local user could read in the process list) and/or a file of them. None of either: local
    # mode, which accepts any ``tml-`` key and listens on loopback only.
    api_keys: str | None = dataclasses.field(default=None, repr=False)
    api_keys_file: Path | None = None
    # Each tenant's share and limits (lilo.tenant_policy, TOML); None: every tenant weight 1, unlimited.
    tenants_file: Path | None = None
    # Trainers follow the cluster's GPUs (cluster.reconciler): one per GPU on every GPU node, as nodes join; one
    # more asked of the autoscaler when every trainer of a base model is full; idle ones let go. None: on an
    # existing cluster (--address) unless --trainers or whole-GPU --samplers fix the layout, with CPU trainers
    # meanwhile while it has no GPU; True waits for GPU nodes instead.
    follow_gpus: bool | None = None
    # Following the GPUs: trainers never let go below this, and never asked for beyond that.
    min_trainers: int = 1
    max_trainers: int = 8
    # Following the GPUs: a trainer with no model for this long is stopped (its node then idles out under the
    # autoscaler's idle_timeout_minutes). 0: never.
    trainer_idle_timeout_s: float = 600.0
    # Following the GPUs: how long a create_model that found every trainer full waits for the trainer it asked
    # for, before its 429 (under the SDK's 60 s request timeout).
    trainer_wait_s: float = 30.0
    # Where checkpoints, their exports and page files are kept (lilo.storage): a URI (s3://bucket/prefix,
    # gs://bucket/prefix) or a directory every node mounts. None: under the home, on each trainer's own node.
    storage: str | None = None
    # Directories whose images requests may point at (image_asset_pointer chunks, OpenAI image_url file:// URLs;
    # lilo.image_assets); none: requests send images' bytes.
    image_dirs: tuple[Path, ...] = ()
    # The futures ledger: a postgresql:// URL (lilo.futures.store). None: SQLite under the home.
    ledger: str | None = dataclasses.field(default=None, repr=False)

    @property
    def ray_temp_dir(self) -> Path:
        return self.home / "ray"

    @property
    def state_file(self) -> Path:
        return self.home / "cluster.json"

    @property
    def futures_db(self) -> Path:
        """The futures database: node-local, beside the cluster's other state."""
        return default_db_path(self.home)

    @property
    def log_file(self) -> Path:
        return self.home / "lilo.log"

    @property
    def api_url(self) -> str:
        host = f"[{self.http_host}]" if ":" in self.http_host else self.http_host
        return f"http://{host}:{self.http_port}"

    @property
    def local_mode(self) -> bool:
        return not self.api_keys and self.api_keys_file is None

    def api_key_digests(self) -> dict[str, str]:
        """``sha256(key) -> tenant`` of the configured keys, read now (empty in local mode)."""
        try:
            return load_key_digests(self.api_keys, self.api_keys_file)
        except ApiKeyConfigError as error:
            raise SettingsError(str(error)) from None

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def ranks_of(self, base_model: str) -> int:
        """How many ranks a trainer of ``base_model`` spans (``trainer_ranks``)."""
        default, overrides = parse_trainer_ranks(self.trainer_ranks)
        return overrides.get(base_model, default)

    @property
    def model_ranks(self) -> dict[str, int]:
        """Every served base model's ranks (``ranks_of``)."""
        return {model: self.ranks_of(model) for model in self.base_models}

    @property
    def most_ranks(self) -> int:
        """The most ranks any base model's trainers span."""
        return max(self.model_ranks.values())

    def model_paths_env(self) -> dict[str, str]:
        """The environment a process needs to find the base models served from a directory under a name of their
        own (``lilo.backend.registry.served_paths``)."""
        return {MODEL_PATHS_ENV: json.dumps(dict(self.model_paths))} if self.model_paths else {}

    def validate(self) -> "Settings":
        _, overrides = parse_trainer_ranks(self.trainer_ranks)
        if self.tenants_file is not None:
            try:
                read_tenants_file(self.tenants_file)
            except TenantsFileError as error:
                raise SettingsError(str(error)) from None
        strangers = sorted(set(overrides) - set(self.base_models))
        if strangers:
            raise SettingsError(f"--trainer-ranks names {', '.join(strangers)}, which no --base-model serves; name "
                                f"one of {', '.join(self.base_models)}.")
        for name in ("http_port", "dashboard_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise SettingsError(f"{name} must be between 1 and 65535, got {port}.")
        if self.http_port == self.dashboard_port:
            raise SettingsError(
                f"The HTTP port and the dashboard port are both {self.http_port}; give --port or --dashboard-port "
                "another value."
            )
        try:
            host = ipaddress.ip_address(self.http_host)
        except ValueError:
            raise SettingsError(f"--host must be an IP address, got {self.http_host!r}.") from None
        if self.local_mode and not host.is_loopback:
            raise SettingsError(
                f"Without API keys lilo accepts any tml- key, so it listens on loopback only, not {self.http_host}; "
                "configure keys (LILO_API_KEYS or --api-keys-file) to listen there.")
        if self.max_adapters < 1:
            raise SettingsError(f"--max-adapters must be at least 1, got {self.max_adapters}.")
        if self.max_rank < 1:
            raise SettingsError(f"--max-rank must be at least 1, got {self.max_rank}.")
        if self.sampler_slots < 0:
            raise SettingsError(f"--sampler-slots must be 0 or more, got {self.sampler_slots}.")
        if self.samplers < 0 or (self.samplers >= 1 and self.samplers != int(self.samplers)):
            raise SettingsError(f"--samplers must be 0 (none), a fraction below 1 (a share of each trainer's GPU) or "
                                f"a whole number (samplers per base model, a GPU each), got {self.samplers:g}.")
        if self.sampler_max_loras < 1:
            raise SettingsError(f"--sampler-max-loras must be at least 1, got {self.sampler_max_loras}.")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise SettingsError(f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}; leave it out to "
                                "size it from each trainer's memory.")
        if self.trainer_memory_gb is not None and self.trainer_memory_gb < 0:
            raise SettingsError(f"--trainer-memory-gb must be 0 (no cap) or more, got {self.trainer_memory_gb:g}; "
                                "leave it out for the default.")
        if self.coalesce_window_ms < 0:
            raise SettingsError(f"--coalesce-window-ms must be 0 (no window) or more, got {self.coalesce_window_ms:g}.")
        if self.host_adapter_mb is not None and self.host_adapter_mb < 0:
            raise SettingsError(f"--host-adapter-mb must be 0 (no host tier) or more, got {self.host_adapter_mb}.")
        if self.disk_adapter_gb < 0:
            raise SettingsError(f"--disk-adapter-gb must be 0 (no disk tier) or more, got {self.disk_adapter_gb}.")
        if self.trainers is not None and self.trainers < 1:
            raise SettingsError(f"--trainers must be at least 1, got {self.trainers}.")
        if self.min_trainers < 0:
            raise SettingsError(f"--min-trainers must be 0 or more, got {self.min_trainers}.")
        if self.max_trainers < max(1, self.min_trainers):
            raise SettingsError(f"--max-trainers must be at least 1 and at least --min-trainers ({self.min_trainers}), "
                                f"got {self.max_trainers}.")
        if self.trainer_idle_timeout_s < 0:
            raise SettingsError("--trainer-idle-timeout must be 0 (never) or more seconds, got "
                                f"{self.trainer_idle_timeout_s}.")
        if self.trainer_wait_s < 0:
            raise SettingsError(f"--trainer-wait must be 0 or more seconds, got {self.trainer_wait_s}.")
        if self.follow_gpus and self.trainers is not None:
            raise SettingsError("--trainers fixes how many trainers run, so they cannot follow the GPUs; leave "
                                "--trainers out, or pass --no-follow-gpus.")
        if self.follow_gpus and self.ray_address is None:
            raise SettingsError("--follow-gpus needs a cluster whose GPU nodes come and go (--address auto on a "
                                "`ray up` head); a private head has this machine's GPUs only, one trainer each.")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise SettingsError(f"--num-cpus must be at least 1, got {self.num_cpus}.")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise SettingsError(f"--device must be auto, cpu or cuda, got {self.device!r}.")
        if not 0 <= self.compute_nice <= 19:
            raise SettingsError(f"--compute-nice must be between 0 and 19, got {self.compute_nice}.")
        if self.stop_save_timeout_s < 0:
            raise SettingsError(
                f"--stop-save-timeout must be 0 (no save) or more seconds, got {self.stop_save_timeout_s}.")
        if self.session_timeout_s < 0:
            raise SettingsError(f"--session-timeout must be 0 (never) or more seconds, got {self.session_timeout_s}.")
        if self.compress_bodies not in COMPRESS_BODIES:
            raise SettingsError(f"--compress-bodies must be one of {', '.join(COMPRESS_BODIES)}, "
                                f"not {self.compress_bodies!r}.")
        for directory in self.image_dirs:
            if not directory.is_dir():
                raise SettingsError(f"--image-dir {directory} is not a directory; name one whose images requests may "
                                    "point at.")
        if self.max_body_mb < 1:
            raise SettingsError(f"--max-body-mb must be at least 1, got {self.max_body_mb}.")
        if not self.base_models:
            raise SettingsError("Configure at least one base model (--base-model NAME).")
        for name, path in self.model_paths:
            if not (Path(path) / "config.json").is_file():
                raise SettingsError(f"--base-model {name}={path}: {path} holds no config.json; point it at a directory "
                                    "holding a transformers model (its config.json, weights and tokenizer).")
        served = dict(self.model_paths)
        unknown = [name for name in self.base_models if name not in served and not is_servable(name)]
        if unknown:
            raise SettingsError(unservable_message(unknown))
        if self.ledger is not None and not is_ledger_url(self.ledger):  # never echoed: it may hold a password
            raise SettingsError("--ledger (LILO_LEDGER) takes a PostgreSQL URL, postgresql://user:password@host:5432/"
                                "database; leave it out for the SQLite file under the home.")
        if self.ray_address is None and len(str(self.ray_temp_dir)) > MAX_RAY_TEMP_DIR_CHARS:
            raise SettingsError(
                f"The Ray temp dir {self.ray_temp_dir} is too long for Ray's unix sockets "
                f"(at most {MAX_RAY_TEMP_DIR_CHARS} characters); pass a shorter --home or set LILO_HOME."
            )
        return self


def parse_trainer_ranks(raw: str) -> tuple[int, dict[str, int]]:
    """``--trainer-ranks``: (the ranks of every base model, the ranks of those named ``MODEL=N``)."""
    default, overrides = 1, {}
    for part in (part.strip() for part in raw.split(",") if part.strip()):
        name, _, count = part.rpartition("=")
        try:
            ranks = int(count)
        except ValueError:
            ranks = 0
        if ranks < 1:
            raise SettingsError(f"--trainer-ranks takes N or MODEL=N with N at least 1, comma-separated; {part!r} "
                                "is neither.")
        if name:
            overrides[name.strip()] = ranks
        else:
            default = ranks
    return default, overrides


def flag(raw: str) -> bool:
    """An on/off environment variable: 1, true or yes; 0, false or no."""
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(raw)


_ENV_FIELDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "LILO_HOME": ("home", Path),
    "LILO_HTTP_HOST": ("http_host", str),
    "LILO_HTTP_PORT": ("http_port", int),
    "LILO_DASHBOARD_PORT": ("dashboard_port", int),
    "LILO_NUM_CPUS": ("num_cpus", int),
    "LILO_TRAINERS": ("trainers", int),
    "LILO_MAX_ADAPTERS": ("max_adapters", int),
    "LILO_TRAINER_RANKS": ("trainer_ranks", str),
    "LILO_MAX_RANK": ("max_rank", int),
    "LILO_SAMPLER_SLOTS": ("sampler_slots", int),
    "LILO_SAMPLERS": ("samplers", float),
    "LILO_SAMPLER_MAX_LORAS": ("sampler_max_loras", int),
    "LILO_MAX_BATCH_TOKENS": ("max_batch_tokens", int),
    "LILO_COALESCE_WINDOW_MS": ("coalesce_window_ms", float),
    "LILO_TRAINER_MEMORY_GB": ("trainer_memory_gb", float),
    "LILO_HOST_ADAPTER_MB": ("host_adapter_mb", int),
    "LILO_DISK_ADAPTER_GB": ("disk_adapter_gb", float),
    "LILO_RAY_ADDRESS": ("ray_address", str),
    "LILO_STARTUP_TIMEOUT_S": ("startup_timeout_s", float),
    "LILO_DEVICE": ("device", str),
    "LILO_MAX_BODY_MB": ("max_body_mb", int),
    "LILO_COMPRESS_BODIES": ("compress_bodies", str),
    "LILO_COMPUTE_NICE": ("compute_nice", int),
    "LILO_SESSION_TIMEOUT_S": ("session_timeout_s", float),
    "LILO_STOP_SAVE_TIMEOUT_S": ("stop_save_timeout_s", float),
    "LILO_API_KEYS": ("api_keys", str),
    "LILO_API_KEYS_FILE": ("api_keys_file", Path),
    "LILO_TENANTS_FILE": ("tenants_file", Path),
    "LILO_FOLLOW_GPUS": ("follow_gpus", flag),
    "LILO_MIN_TRAINERS": ("min_trainers", int),
    "LILO_MAX_TRAINERS": ("max_trainers", int),
    "LILO_TRAINER_IDLE_TIMEOUT_S": ("trainer_idle_timeout_s", float),
    "LILO_TRAINER_WAIT_S": ("trainer_wait_s", float),
    "LILO_STORAGE": ("storage", str),
    "LILO_IMAGE_DIRS": ("image_dirs", lambda raw: tuple(Path(part) for part in raw.split(os.pathsep) if part)),
    "LILO_LEDGER": ("ledger", str),
}



def load_settings(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Build and validate the settings; ``overrides`` whose value is None are ignored."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for variable, (field, kind) in _ENV_FIELDS.items():
        raw = env.get(variable)
        if raw:
            try:
                values[field] = kind(raw)
            except ValueError:
                raise SettingsError(f"{variable}={raw!r} is not a valid {kind.__name__}.") from None
    if env.get("LILO_BASE_MODELS"):
        values["base_models"] = tuple(name.strip() for name in env["LILO_BASE_MODELS"].split(",") if name.strip())
    values.update({key: value for key, value in overrides.items() if value is not None})
    for field in ("home", "api_keys_file", "tenants_file"):
        if field in values:
            values[field] = Path(values[field]).expanduser().absolute()
    if "image_dirs" in values:
        values["image_dirs"] = tuple(Path(directory).expanduser().absolute() for directory in values["image_dirs"])
    if "base_models" in values:
        values["base_models"], values["model_paths"] = _split_model_paths(values["base_models"])
    return Settings(**values).validate()


def _split_model_paths(entries: Iterable[str]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``--base-model`` entries, each a name or ``NAME=PATH``: the names, and (name, absolute path) of each served
    from a directory under a name of its own."""
    names, paths = [], []
    for entry in entries:
        name, separator, path = entry.partition("=")
        names.append(name.strip())
        if separator:
            paths.append((name.strip(), str(Path(path.strip()).expanduser().absolute())))
    return tuple(names), tuple(paths)
