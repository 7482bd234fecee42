"""Experiment tracking: a run's records sent to Weights & Biases and MLflow besides
`metrics.jsonl` (always written: the source of truth the report reads) and TensorBoard.

`logging.backends` names them, comma-separated: `tensorboard` (the default), `wandb`, `mlflow`,
`jsonl` (always on; naming it changes nothing). Process 0 alone writes. The metric names are
`metrics.jsonl`'s, at its steps; a record's numbers go to every backend (lists and text stay in
`metrics.jsonl`). The resolved config (secrets redacted) is the wandb run config and the MLflow
run's parameters. A resumed run continues the same wandb run and MLflow run: their ids are kept
in `<workdir>/tracking.json`.

wandb: `logging.wandb.mode=auto` runs online when an API key is configured (`WANDB_API_KEY` or
`wandb login`), else offline into `<workdir>/wandb/` (`wandb sync` uploads it later). MLflow: a
local file store in `<workdir>/mlruns` (MLflow 3 keeps that store in maintenance and asks for
`MLFLOW_ALLOW_FILE_STORE=true`, set here for it) unless `logging.mlflow.tracking_uri` names a
server or a database (`sqlite:///...`).

A backend that fails (a server that cannot be reached, a package not installed, a rejected
value) is reported once, by name, and dropped: the run goes on with the others.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from typing import Callable, Optional

from jaxrl_llm import validation as V

BACKENDS = ("tensorboard", "wandb", "mlflow", "jsonl")
IDS = "tracking.json"


def names(backends: str) -> list:
    return [b.strip() for b in backends.split(",") if b.strip()]


SECTION = V.Section(
    backends=("tensorboard", V.Rule(f"a comma-separated list of {', '.join(BACKENDS)}",
                                    lambda x: isinstance(x, str) and set(names(x)) <= set(BACKENDS),
                                    ("tensorboard,comet",))),
    wandb=V.Section(project=("jaxrl_llm", V.text()), entity=("", V.text()), name=("", V.text()),  # name: the workdir's
                    tags=("", V.text()), group=("", V.text()), mode=("auto", V.one_of("auto", "online", "offline"))),
    mlflow=V.Section(tracking_uri=("", V.text()), experiment=("jaxrl_llm", V.text())),  # "": <workdir>/mlruns
)
default_config = SECTION.config
RULES = SECTION.rules


def scalars(record: dict) -> dict:
    """The record's finite numbers (booleans and the step left out)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class _Ids:
    """`<workdir>/tracking.json`: each backend's run id, so a resumed run continues it."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, IDS)
        self.ids = json.load(open(self.path)) if os.path.isfile(self.path) else {}

    def keep(self, backend: str, run_id: str) -> None:
        self.ids[backend] = run_id
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.ids, f)
        os.replace(self.path + ".tmp", self.path)


class Wandb:
    name = "wandb"

    def __init__(self, c, workdir: str, config: dict, ids: _Ids):
        import wandb

        mode = c.mode if c.mode != "auto" else ("online" if _wandb_key() else "offline")
        run_id = ids.ids.get(self.name) or secrets.token_hex(6)  # wandb's ids: lowercase letters and digits
        self._wandb = wandb
        self.run = wandb.init(project=c.project, entity=c.entity or None, name=c.name or os.path.basename(
            os.path.abspath(workdir)), tags=names(c.tags) or None, group=c.group or None, config=config, id=run_id,
            resume="allow", dir=workdir, mode=mode, reinit="create_new",
            settings=wandb.Settings(init_timeout=60, console="off", silent=True))
        ids.keep(self.name, run_id)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def image(self, name: str, path: str) -> None:
        self.run.log({name: self._wandb.Image(path)})

    def close(self) -> None:
        self.run.finish()


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    return os.path.isfile(netrc) and "api.wandb.ai" in open(netrc).read()


class Mlflow:
    name = "mlflow"
    _BAD = re.compile(r"[^\w\-. /]")  # MLflow's allowed key characters

    def __init__(self, c, workdir: str, config: dict, ids: _Ids):
        from mlflow.tracking import MlflowClient

        uri = c.tracking_uri
        if not uri:  # the local file store MLflow 3 keeps in maintenance: still read by `mlflow ui`, opted into here
            uri = "file:" + os.path.abspath(os.path.join(workdir, "mlruns"))
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = ids.ids.get(self.name)
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(c.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(c.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=os.path.basename(os.path.abspath(workdir))).info.run_id
            self._params(config)
        ids.keep(self.name, self.run_id)

    def _params(self, config: dict) -> None:
        from mlflow.entities import Param

        flat = list(V.flatten(config).items())
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=[Param(k, json.dumps(v)[:500]) for k, v in flat[i:i + 100]])

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(self._BAD.sub("_", k), v, now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def image(self, name: str, path: str) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path="figures")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_MAKERS = {"wandb": Wandb, "mlflow": Mlflow}


class Trackers:
    """The run's wandb / MLflow writers (process 0's; none elsewhere). `log(record)` sends a
    `metrics.jsonl` record to each; a failing one is reported through `say` once and dropped."""

    def __init__(self, c, workdir: str, config: dict, say: Callable[[str], None], enabled: bool = True):
        self.say, self.live = say, []
        if not enabled:
            return
        ids = _Ids(workdir)
        for name in names(c.backends):
            if name in _MAKERS:
                self._guard(name, lambda name=name: self.live.append(_MAKERS[name](c[name], workdir, config, ids)))

    def _guard(self, name: str, fn) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # any failure of a tracking service: reported, never fatal
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            self.say(f"warning: logging to {name} failed ({type(e).__name__}: {msg}); the run goes on without it")
            return False

    def log(self, record: dict) -> None:
        if not scalars(record):  # e.g. a resume's config changes: text only
            return
        for t in list(self.live):
            if not self._guard(t.name, lambda t=t: t.log(record)):
                self.live.remove(t)

    def images(self, paths: dict) -> None:
        """{name: png path}: figures logged at the end of a run."""
        for t in list(self.live):
            for name, path in paths.items():
                self._guard(t.name, lambda t=t, n=name, p=path: t.image(n, p))

    def close(self) -> None:
        for t in self.live:
            self._guard(t.name, t.close)
        self.live = []


def tensorboard(c, train_tensorboard: bool) -> bool:
    """Whether TensorBoard events are written: named in `logging.backends`, and not turned off
    by `train.tensorboard=False`."""
    return "tensorboard" in names(c.backends) and train_tensorboard


def section(config) -> Optional[object]:
    """The run's `logging` section (defaults for a config written before it existed)."""
    return config.get("logging") or default_config()
