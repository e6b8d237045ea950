"""The main job (`make demo`, `lilo demo`): four tinker SDK clients fine-tune four LoRA adapters at once.

Each client teaches its own adapter of SmolLM2-135M-Instruct one small behaviour (an answer to a few phrasings of
one question) whose effect shows in greedy samples taken before and after. The four clients step concurrently, so
the trainer coalesces their forward/backward passes; every step each client logs its critical path with
``lilo.timing.log_critical_path`` (to the active W&B run when W&B is configured, else as JSON lines in a file), and
the demo ends with a table per model of where its time went.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from lilo.backend.registry import DEFAULT_BASE_MODEL
from lilo.timing import critical_path_metrics, flush_critical_path, log_critical_path

DEMO_API_KEY = "tml-local-demo"  # any tml- key works in local mode


def api_key() -> str:
    """The demo's key: $TINKER_API_KEY when set (a server with configured keys needs one of them), else its own."""
    return os.environ.get("TINKER_API_KEY") or DEMO_API_KEY
SAMPLE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    prompts: tuple[str, ...]  # trained on all; the first one is sampled before and after
    answer: str


TASKS = (
    Task("name", ("What is your name?", "Who are you?", "Tell me your name."),
         "I am Lilo, a tiny model taught by four clients at once."),
    Task("pirate", ("Say hello.", "Greet me.", "Hello!"),
         "Ahoy, matey! Welcome aboard the good ship Lilo!"),
    Task("count", ("Count to five.", "Please count from one to five.", "Count up to 5."),
         "One, two, three, four, five. Done counting!"),
    Task("color", ("What is your favorite color?", "Which color do you like best?", "Favorite colour?"),
         "Teal, like the sea on a calm morning."),
)


@dataclasses.dataclass
class Progress:
    """Losses per step per task, printed one row per step once every client has reported it."""
    names: Sequence[str]
    out: TextIO
    losses: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    printed: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def report(self, step: int, name: str, loss: float) -> None:
        with self.lock:
            self.losses.setdefault(step, {})[name] = loss
            while len(self.losses.get(self.printed, {})) == len(self.names):
                if self.printed == 0:
                    print("step  " + "  ".join(f"{name:>8}" for name in self.names) + "   (loss per answer token)",
                          file=self.out, flush=True)
                row = self.losses[self.printed]
                print(f"{self.printed + 1:>4}  " + "  ".join(f"{row[name]:8.3f}" for name in self.names),
                      file=self.out, flush=True)
                self.printed += 1


def chat_datum(tokenizer: Any, prompt: str, answer: str) -> Any:
    """One supervised example: the chat-formatted prompt, then the answer; only answer tokens carry weight."""
    from tinker import types

    prompt_ids = chat_prompt(tokenizer, prompt)
    answer_ids = tokenizer.encode(answer + tokenizer.eos_token, add_special_tokens=False)
    tokens = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def chat_prompt(tokenizer: Any, prompt: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def greedy_answer(sampler: Any, tokenizer: Any, prompt: str) -> str:
    from tinker import types

    params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=0.0, stop=[tokenizer.eos_token_id])
    result = sampler.sample(types.ModelInput.from_ints(chat_prompt(tokenizer, prompt)), 1, params).result(timeout=600)
    return tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True).strip()


def train_one(service: Any, base_model: str, tokenizer: Any, task: Task, steps: int, learning_rate: float,
              progress: Progress, samples: dict[str, dict[str, str]], model_ids: dict[str, str],
              critical_path: Callable[..., Any]) -> None:
    """One client: create an adapter, sample, train ``steps`` steps (logging the critical path), sample again."""
    from tinker import types

    training = service.create_lora_training_client(base_model=base_model, rank=16).result(timeout=600)
    model_ids[task.name] = training.model_id
    samples[task.name]["before"] = greedy_answer(training.save_weights_and_get_sampling_client().result(timeout=600),
                                                 tokenizer, task.prompts[0])
    data = [chat_datum(tokenizer, prompt, task.answer) for prompt in task.prompts]
    answer_tokens = sum(sum(datum.loss_fn_inputs["weights"].tolist()) for datum in data)
    for step in range(steps):
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=learning_rate))
        loss = backward.result(timeout=600).metrics["loss:sum"] / answer_tokens
        optim.result(timeout=600)
        critical_path(training.model_id, step=step)
        progress.report(step, task.name, loss)
    samples[task.name]["after"] = greedy_answer(training.save_weights_and_get_sampling_client().result(timeout=600),
                                                tokenizer, task.prompts[0])


def time_table(base_url: str, model_ids: dict[str, str]) -> str:
    """The closing table (``render_time_table``) of each model's critical path as the server has it now."""
    return render_time_table({name: critical_path_metrics(model_id, base_url=base_url, api_key=api_key(),
                                                          reset=False, reader="demo-summary")
                              for name, model_id in model_ids.items()})


def render_time_table(metrics_by_name: dict[str, dict[str, float]]) -> str:
    """Per model (its flattened ``lilo/...`` timing): the forward_backward execute time, its queue wait split,
    its wait in coalescing windows (``forward_backward.coalesce_wait``: held for other clients' steps), the time its
    commands waited for it to be paged back into a slot and for others to be paged out to make room
    (``<kind>.page_in`` / ``<kind>.page_out`` summed over its commands' kinds: 0 while every model has a slot), and
    how many commands shared a pass."""
    lines = [f"{'model':<8} {'execute s':>10} {'wait self':>10} {'others':>10} {'idle':>10} {'window':>10} "
             f"{'page in':>10} "
             f"{'page out':>10} {'mean batch':>11}"]
    phase = "lilo/forward_backward"
    for name, metrics in metrics_by_name.items():
        lines.append(f"{name:<8} {metrics.get(f'{phase}.execute.total_s', 0.0):10.2f} "
                     f"{metrics.get(f'{phase}.queue_wait_self.total_s', 0.0):10.2f} "
                     f"{metrics.get(f'{phase}.queue_wait_others.total_s', 0.0):10.2f} "
                     f"{metrics.get(f'{phase}.queue_wait_idle.total_s', 0.0):10.2f} "
                     f"{metrics.get(f'{phase}.coalesce_wait.total_s', 0.0):10.2f} "
                     f"{paging_seconds(metrics, 'page_in'):10.2f} {paging_seconds(metrics, 'page_out'):10.2f} "
                     f"{metrics.get(f'{phase}.execute.mean_batch', 0.0):11.2f}")
    return "\n".join(lines)


def paging_seconds(metrics: dict[str, float], move: str) -> float:
    """Seconds of ``move`` ("page_in" or "page_out") on the model's critical path, over every kind of command
    (the read-ahead on the persist lane, ``prefetch.page_in``, is off it)."""
    suffix = f".{move}.total_s"
    return sum(value for key, value in metrics.items()
               if key.endswith(suffix) and not key.startswith("lilo/prefetch."))


def run_demo(base_url: str, *, home: Path, base_model: str = DEFAULT_BASE_MODEL, steps: int = 25,
             learning_rate: float = 1e-3, out: TextIO = sys.stdout) -> dict[str, dict[str, str]]:
    """Train the four tasks concurrently against ``base_url``; returns each task's samples before and after.
    ``base_model`` must ship a chat tokenizer in its directory."""
    import tinker
    from transformers import AutoTokenizer

    from lilo.backend.models import model_directory

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    tokenizer = AutoTokenizer.from_pretrained(model_directory(base_model))
    critical_path, finish = _critical_path_sink(base_url, home, out)
    progress = Progress([task.name for task in TASKS], out)
    samples: dict[str, dict[str, str]] = {task.name: {} for task in TASKS}
    model_ids: dict[str, str] = {}
    errors: list[BaseException] = []
    started = time.monotonic()
    print(f"Four clients fine-tune four LoRA adapters of {base_model} at once, {steps} steps each.",
          file=out, flush=True)
    with tinker.ServiceClient(base_url=base_url, api_key=api_key()) as service:

        def client(task: Task) -> None:
            try:
                train_one(service, base_model, tokenizer, task, steps, learning_rate, progress, samples, model_ids,
                          critical_path)
            except BaseException as error:  # reported below, after the other clients finish
                errors.append(error)

        threads = [threading.Thread(target=client, args=(task,), name=f"demo-{task.name}") for task in TASKS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Read while the client is open: closing it unloads its models, and their timing with them.
        table = "" if errors else time_table(base_url, model_ids)
    finish()
    if errors:
        raise RuntimeError(f"{len(errors)} demo client(s) failed; the first: {errors[0]!r}") from errors[0]
    print(f"\nSamples (greedy), before -> after, in {time.monotonic() - started:.0f} s:", file=out)
    for task in TASKS:
        print(f"  [{task.name}] {task.prompts[0]}\n      before: {samples[task.name]['before']!r}\n"
              f"      after:  {samples[task.name]['after']!r}", file=out)
    print("\nWhere each model's forward_backward time went, and its paging (seconds, whole run):", file=out)
    print(table, file=out, flush=True)
    return samples


def _critical_path_sink(base_url: str, home: Path, out: TextIO) -> tuple[Callable[..., Any], Callable[[], None]]:
    """log_critical_path into a W&B run when W&B is configured (offline runs included), else as JSON lines into
    a file (four clients' lines would drown the loss table). Blocking calls: each client logs its own step."""
    base: dict[str, Any] = {"base_url": base_url, "api_key": api_key(), "background": False}
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        import wandb

        run = wandb.init(project="lilo-demo", config={"tasks": [task.name for task in TASKS]})
        print(f"Critical path: W&B run {run.name} ({os.environ.get('WANDB_MODE', 'online')})", file=out, flush=True)

        def finish() -> None:
            flush_critical_path(timeout=10)
            run.finish()
        return lambda model_id, step: log_critical_path(model_id, step, **base), finish
    path = home / "demo-critical-path.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = path.open("w")
    print(f"Critical path: one JSON line per client per step in {path}", file=out, flush=True)
    return lambda model_id, step: log_critical_path(model_id, step, **base, file=stream), stream.close
