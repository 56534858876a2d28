"""lm-eval's tasks during training (`eval.tasks`): at every `eval.tasks_every_steps` steps and the last, the tasks
run on the training mesh with the params as the step left them (`JaxparLM` over the trainer's own steps: no
copy, no other layout); their metrics are logged as `eval/<task>/<metric>` (metrics.jsonl, TensorBoard, W&B) and
lm-eval's results JSON is kept beside that step's checkpoint, `WORKDIR/lm_eval/step_<N>.json`.

The tasks are loaded (their datasets read) when the run starts, so a task that needs a download here stops the run
with one line before the first step. The step watchdog is off while the tasks run (they take what they take).
"""
from __future__ import annotations

import json
import os

import jax

from jaxpar import data
from jaxpar.cluster import watchdog
from jaxpar.errors import ConfigError
from jaxpar.evaluate.tasks import MODEL, TaskError, flat_metrics, load_tasks, register
from jaxpar.generate.source import Source

RESULTS_DIR = "lm_eval"


def results_path(workdir: str, step: int) -> str:
    """Where step `step`'s lm-eval results JSON is kept."""
    return os.path.join(workdir, RESULTS_DIR, f"step_{step}.json")


class Tasks:
    """The run's lm-eval tasks: `due(step)`, and `__call__(step, params)` -> the metrics to log (and the JSON
    kept); nothing when `eval.tasks` is empty."""

    def __init__(self, config, steps, workdir: str):
        e = config.eval
        self.names = [t.strip() for t in str(e.tasks).split(",") if t.strip()]
        self.every, self.total = int(e.tasks_every_steps), int(config.train.steps)
        self.workdir, self.steps, self.config = workdir, steps, config
        self.limit = float(e.tasks_limit) or None
        self.fewshot = None if int(e.tasks_fewshot) < 0 else int(e.tasks_fewshot)
        self.batch, self.chat = int(config.train.global_batch_size), bool(e.tasks_chat)
        self.manager, self.tokenizer = None, None
        if self.names:
            self.tokenizer = data.load_tokenizer(os.path.join(workdir, "tokenizer"))
            try:
                import lm_eval  # noqa: F401
            except ImportError:
                raise ConfigError(f"eval.tasks={e.tasks!r} needs lm-eval: pip install 'jaxpar[eval]'.") from None
            try:
                self.manager = load_tasks(self.names, str(e.tasks_include) or None)
            except TaskError as err:
                raise ConfigError(f"eval.tasks: {err}") from None

    def due(self, step: int) -> bool:
        return bool(self.names) and (step == self.total or (self.every > 0 and step % self.every == 0))

    def __call__(self, step: int, params) -> dict[str, float]:
        if not self.due(step):
            return {}
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable

        register()
        source = Source(self.steps.fwd, params, self.tokenizer, None, self.steps, self.config)
        limit = int(self.limit) if self.limit and self.limit >= 1 else self.limit
        watchdog.disarm()  # the tasks take what they take: no step bound while they run (re-armed after)
        try:
            results = simple_evaluate(model=MODEL, model_args={"source": source}, batch_size=self.batch,
                                      tasks=self.names, num_fewshot=self.fewshot, limit=limit,
                                      apply_chat_template=self.chat, task_manager=self.manager)
        finally:
            d = self.config.dist
            watchdog.arm_steps(float(d.step_timeout_s), float(d.step_timeout_min_s), float(d.step_timeout_factor))
        if jax.process_index() == 0:
            path = results_path(self.workdir, step)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        return flat_metrics(results)
