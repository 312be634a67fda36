"""The trained model as an MLflow pyfunc: a request table in, one probability per task out.

Input: one row per request with user_id, item_id, surface, the sparse and dense feature columns, and
the history as list columns (history_item_id, history_surface, history_event_type, history_action,
history_age_seconds, history_<item feature>), most recent event last. A model trained with retrieved events
(sequence.retrieved_events) also takes the row's retrieved older events of its item as the same list columns
named retrieved_* (oldest first; gem_ops.serving.client.retrieve finds them). Output: p_<objective> for every
objective.
The package holds the weights, the feature spec and the model config, and the project's code, so
`mlflow.pyfunc.load_model("models:/gem@champion")` works from any checkout-free environment with the
pinned dependencies.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.entities import LoggedModelOutput
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceBatch
from gem_ops.model.config import FeatureSpec
from gem_ops.model.features import model_input
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import PROJECT_ROOT
from gem_ops.train.model_state import load_model_state, model_from_state, model_state

MODEL_STATE = "model_state"
INPUT_EXAMPLE_ROWS = 4  # eval requests saved with the model as its input example
HISTORY_COLUMNS = ("history_item_id", "history_surface", "history_event_type", "history_action", "history_age_seconds")
RETRIEVED_PREFIX = "retrieved_"
# A student with representation transfer also takes its teacher's representation of the request.
TEACHER_REPRESENTATION = "teacher_representation"


def input_example(data, indices: np.ndarray, model: GEMModel) -> pd.DataFrame:
    """The request table of the first INPUT_EXAMPLE_ROWS examples at `indices` of `data` (logs), as the model reads
    them (its history length and retrieved events): the example a logged model carries."""
    sequence = model.config.sequence
    return batch_to_frame(data.batch(indices[:INPUT_EXAMPLE_ROWS], sequence.max_history_len,
                                     retrieved_events=sequence.retrieved_events,
                                     retrieval_key=sequence.retrieval_key), model.spec)


def batch_to_frame(batch: SequenceBatch, spec: FeatureSpec) -> pd.DataFrame:
    """A loader batch as the pyfunc's request table (categories as their names; a batch's retrieved events in
    the retrieved_* columns)."""
    offsets = batch.history_offsets.numpy()
    surfaces, event_types = np.array(spec.surfaces), np.array(spec.event_types)
    retrieved = None if batch.retrieved_lengths is None else offsets[:-1] + batch.retrieved_lengths.numpy()

    def events(prefix: str, starts: np.ndarray, ends: np.ndarray) -> dict[str, list[list[Any]]]:
        def split(values: np.ndarray) -> list[list[Any]]:
            return [values[a:b].tolist() for a, b in zip(starts, ends)]

        return {
            f"{prefix}item_id": split(batch.history_item_id.numpy()),
            f"{prefix}surface": split(surfaces[batch.history_surface.numpy()]),
            f"{prefix}event_type": split(event_types[batch.history_event_type.numpy()]),
            f"{prefix}action": split(batch.history_action.numpy()),
            f"{prefix}age_seconds": split(batch.history_age_seconds.numpy()),
            **{f"{prefix}{name}": split(batch.history_item_features[name].numpy())
               for name in spec.history_item_features},
        }

    frame = {
        "user_id": batch.user_id.numpy(),
        "item_id": batch.item_id.numpy(),
        "surface": surfaces[batch.surface.numpy()],
        **{name: batch.sparse_features[name].numpy() for name in spec.sparse_features},
        **{name: batch.dense_features[:, i].numpy() for i, name in enumerate(spec.dense_features)},
        **events("history_", offsets[:-1] if retrieved is None else retrieved, offsets[1:]),
        **({} if retrieved is None else events(RETRIEVED_PREFIX, offsets[:-1], retrieved)),
    }
    if batch.teacher_representation is not None:
        frame[TEACHER_REPRESENTATION] = batch.teacher_representation.float().numpy().tolist()
    return pd.DataFrame(frame)


def frame_to_batch(frame: pd.DataFrame, spec: FeatureSpec, retrieved: bool = False) -> SequenceBatch:
    """The request table back to a batch (with `retrieved`, each row's retrieved_* events before its history);
    unknown surface or event-type names are an error naming the column."""
    columns = [*HISTORY_COLUMNS, *(f"history_{name}" for name in spec.history_item_features)]
    retrieved_columns = [RETRIEVED_PREFIX + c.removeprefix("history_") for c in columns]
    missing = [c for c in ("user_id", "item_id", "surface", *spec.sparse_features, *spec.dense_features, *columns,
                           *(retrieved_columns if retrieved else ())) if c not in frame.columns]
    if missing:
        raise ValueError(f"request table lacks column(s) {missing}"
                         + (" (this model reads retrieved events: gem_ops.serving.client.retrieve)"
                            if retrieved else ""))
    if not retrieved and any(c in frame.columns for c in retrieved_columns):
        raise ValueError(f"request table has retrieved_* columns, but this model was trained without retrieved events "
                         f"(sequence.retrieved_events 0): drop {[c for c in retrieved_columns if c in frame.columns]}")
    lengths = np.array([len(h) for h in frame["history_item_id"]], dtype=np.int64)
    found = (np.array([len(h) for h in frame[retrieved_columns[0]]], dtype=np.int64) if retrieved
             else np.zeros(len(frame), dtype=np.int64))
    offsets = np.zeros(len(frame) + 1, dtype=np.int64)
    np.cumsum(found + lengths, out=offsets[1:])

    def flat(column: str, dtype) -> np.ndarray:
        """The column's events and, before each row's, its retrieved ones."""
        retrieved_column = RETRIEVED_PREFIX + column.removeprefix("history_")
        rows = zip(frame[retrieved_column], frame[column]) if retrieved else (((), row) for row in frame[column])
        values = [v for before, row in rows for part in (before, row) for v in part]
        for name, counts in ((column, lengths), *(((retrieved_column, found),) if retrieved else ())):
            if [len(row) for row in frame[name]] != counts.tolist():
                raise ValueError(f"request column '{name}': list lengths differ from "
                                 f"{name.split('_')[0]}_item_id's")
        return np.asarray(values, dtype=dtype)

    def codes(column: str, vocabulary: tuple[str, ...], values) -> np.ndarray:
        index = {name: i for i, name in enumerate(vocabulary)}
        unknown = sorted({v for v in values if v not in index})
        if unknown:
            raise ValueError(f"request column '{column}': unknown value(s) {unknown[:5]}; known: {list(vocabulary)}")
        return np.array([index[v] for v in values], dtype=np.int64)

    n, t = len(frame), len(spec.objectives)
    dense = (np.stack([frame[c].to_numpy(np.float32) for c in spec.dense_features], 1) if spec.dense_features
             else np.zeros((n, 0), np.float32))
    def t_(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(array))  # pandas may hand out read-only views
    return SequenceBatch(
        example_index=torch.arange(n),
        timestamp=torch.zeros(n, dtype=torch.int64),
        user_id=t_(frame["user_id"].to_numpy(np.int64)),
        item_id=t_(frame["item_id"].to_numpy(np.int64)),
        surface=t_(codes("surface", spec.surfaces, frame["surface"])),
        sparse_features={c: t_(frame[c].to_numpy(np.int64)) for c in spec.sparse_features},
        dense_features=t_(dense),
        labels=torch.zeros(n, t),
        label_mask=torch.zeros(n, t, dtype=torch.bool),
        history_offsets=t_(offsets),
        history_item_id=t_(flat("history_item_id", np.int64)),
        history_surface=t_(codes("history_surface", spec.surfaces, flat("history_surface", object))),
        history_event_type=t_(codes("history_event_type", spec.event_types, flat("history_event_type", object))),
        teacher_representation=(torch.tensor(np.stack([np.asarray(r, np.float32)
                                                       for r in frame[TEACHER_REPRESENTATION]]))
                                if TEACHER_REPRESENTATION in frame.columns and n else None),
        history_action=t_(flat("history_action", np.int64)),
        history_age_seconds=t_(flat("history_age_seconds", np.float32)),
        history_item_features={name: t_(flat(f"history_{name}", np.int64)) for name in spec.history_item_features},
        retrieved_lengths=t_(found) if retrieved else None,
    )


class GEMPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        self.model = model_from_state(load_model_state(context.artifacts[MODEL_STATE])).eval()

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return predict_frame(self.model, model_input)


@torch.no_grad()
def predict_frame(model: GEMModel, frame: pd.DataFrame) -> pd.DataFrame:
    batch = frame_to_batch(frame, model.spec, retrieved=model.config.sequence.retrieved_events > 0)
    limit = model.config.sequence.max_history_len
    if batch.size and int(batch.history_lengths.max()) > limit:
        batch = _cut_histories(batch, limit)
    probabilities = torch.sigmoid(model(model_input(batch, model.spec, model.config)).float())
    return pd.DataFrame({f"p_{t}": probabilities[:, i].numpy() for i, t in enumerate(model.objectives)})


def log_model(client: MlflowClient, run_id: str, model: GEMModel, input_example: pd.DataFrame,
              registered_name: str | None = None, artifact_path: str = "model",
              version_tags: dict[str, str] | None = None) -> str | None:
    """Saves the pyfunc as an MLflow logged model, an output of the run (it shows in the run's and the
    experiment's Models views), and, given a name, registers a new version of it (with the given tags);
    returns the version."""
    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "model_state.pt"
        torch.save(model_state(model), state_path)
        package = Path(tmp) / artifact_path
        with warnings.catch_warnings():
            # The example's id columns are integers by design (never missing): MLflow's hint about them is noise.
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
            _save_package(package, state_path, input_example, model)
        experiment_id = client.get_run(run_id).info.experiment_id
        logged = client.create_logged_model(experiment_id, name=registered_name or artifact_path, source_run_id=run_id,
                                            tags=version_tags, model_type="pyfunc")
        client.log_model_artifacts(logged.model_id, os.fspath(package))
        client.finalize_logged_model(logged.model_id, "READY")
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    if registered_name is None:
        return None
    try:
        client.create_registered_model(registered_name)
    except mlflow.exceptions.MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(registered_name, logged.artifact_location, run_id=run_id, tags=version_tags,
                                          model_id=logged.model_id)
    return version.version


def _save_package(package: Path, state_path: Path, input_example: pd.DataFrame, model: GEMModel) -> None:
    mlflow.pyfunc.save_model(
        package,
        python_model=str(Path(__file__).with_name("pyfunc_model_code.py")),
        artifacts={MODEL_STATE: str(state_path)},
        code_paths=[str(PROJECT_ROOT / "gem_ops"), str(PROJECT_ROOT / "kernels")],
        input_example=input_example,
        # Inferred here, from a real prediction, so a model that cannot predict fails loudly now.
        signature=infer_signature(input_example, predict_frame(model, input_example)),
        pip_requirements=_requirements(),
    )


def _requirements() -> list[str]:
    lines = [line.split("#")[0].strip() for name in ("requirements.txt", "requirements-nodeps.txt")
             for line in (PROJECT_ROOT / name).read_text().splitlines()]
    wanted = ("torch", "numpy", "polars", "pyarrow", "fbgemm-gpu-cpu", "tensordict", "torchmetrics", "mlflow",
              "torchrec")
    return [line for line in lines if line and line.split("=")[0].strip() in wanted]


def _cut_histories(batch: SequenceBatch, limit: int) -> SequenceBatch:
    """Each request's most recent history events, as training saw them: `limit` of them, less its retrieved
    events, which it keeps."""
    from gem_ops.model.jagged import positions_from_end, select

    rows = torch.arange(batch.history_item_id.numel())
    offsets, lengths = batch.history_offsets, batch.history_lengths
    found = torch.zeros_like(lengths) if batch.retrieved_lengths is None else batch.retrieved_lengths
    of_row = torch.repeat_interleave(found, lengths)
    retrieved = rows - torch.repeat_interleave(offsets[:-1], lengths) < of_row
    rows, offsets = select(rows, offsets, retrieved | (positions_from_end(offsets, rows.numel()) < limit - of_row))
    values = {f: getattr(batch, f)[rows] for f in HISTORY_COLUMNS}
    features = {name: v[rows] for name, v in batch.history_item_features.items()}
    return SequenceBatch(**{**batch.__dict__, **values, "history_offsets": offsets, "history_item_features": features})
