"""lm-eval's side of evaluation: its tasks loaded (one line for a task that needs a download here), the `jaxpar`
model registered lazily (lm-eval is imported only when evaluation runs: the `eval` extra), metric names for
logging."""
from __future__ import annotations

import re

from jaxpar.errors import ConfigError

MODEL = "jaxpar"  # the name lm-eval knows the backend by


class TaskError(ConfigError):
    """A task that cannot be loaded: one line."""


def register() -> None:
    """Make `--model jaxpar` known to lm-eval's registry (lazily: `jaxpar.evaluate.lm` is imported at first use)."""
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target="jaxpar.evaluate.lm:JaxparLM")


def offline_dataset(error: BaseException) -> str | None:
    """The dataset a task could not fetch (datasets' "Couldn't reach 'ORG/NAME' on the Hub"), else None."""
    m = re.search(r"Couldn't reach '([^']+)' on the Hub", str(error))
    return m.group(1) if m else None


def load_tasks(names: list[str], include_path: str | None):
    """lm-eval's TaskManager with the tasks loaded once (their datasets read): one line for a task that needs a
    download here (`TaskError`)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    for name in names:
        try:
            manager.load([name])
        except ConnectionError as e:
            ds = offline_dataset(e)
            if ds is None:
                raise
            raise TaskError(f"task {name} needs the dataset {ds}, which is not in the Hugging Face cache and cannot "
                            f"be fetched here: on a machine online run `hf download {ds} --repo-type dataset` "
                            f"(then copy ~/.cache/huggingface here), or point a local task YAML at the files "
                            f"(dataset_path: json, data_files; --include_path).") from None
        except (KeyError, ValueError) as e:
            if name not in str(e):
                raise
            raise TaskError(f"task {name}: {str(e).splitlines()[0]} (lm-eval's task names: `lm-eval ls tasks`; "
                            f"a local task: --include_path DIR).") from None
    return manager


def metric_name(task: str, key: str) -> str:
    """lm-eval's `acc,none` of `task` -> `eval/<task>/acc` (another filter than `none`: `acc/<filter>`)."""
    metric, _, filt = key.partition(",")
    return f"eval/{task}/{metric}" + (f"/{filt}" if filt and filt != "none" else "")


def flat_metrics(results: dict) -> dict[str, float]:
    """{`eval/<task>/<metric>`: value} of lm-eval's results: its metrics (`metric,filter` keys), no standard errors
    (nor `alias`, `sample_len`)."""
    return {metric_name(task, k): float(v) for task, r in results["results"].items() for k, v in r.items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
