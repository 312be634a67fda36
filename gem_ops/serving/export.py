"""A vertical model as a serving artifact: torch.export programs of ServingGraph (dynamic candidate count and
history length), as an ExportedProgram or compiled ahead of time by AOTInductor, beside serving.json (the
request's inputs, the outputs, the vocabularies) and serving_client.py (the torch-only client)."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim

from gem_ops.data.atomic import atomic_path
from gem_ops.model.gem import GEMModel
from gem_ops.serving import client
from gem_ops.serving.graph import ServingGraph
from gem_ops.serving.request import REQUEST_INPUTS, request_inputs

FORMATS = ("exported_program", "aot_inductor")
MAX_CANDIDATES = 1 << 16
MAX_HISTORY = 1 << 20
CANDIDATE_INPUTS = client.CANDIDATE_INPUTS
# History lengths the dynamic program leaves out, each traced on its own: its shape rules exclude one event
# (checked when it runs), and AOTInductor's compiled code divides by the length (an empty history would
# crash the process).
SHORT_HISTORIES = {"exported_program": (1,), "aot_inductor": (0, 1)}
HISTORY_INPUTS = tuple(name for name in REQUEST_INPUTS if name.startswith("history_"))


@dataclass(frozen=True)
class ServingExport:
    folder: str
    format: str
    seconds: float  # export (and compilation) time

    def to_dict(self) -> dict:
        return asdict(self)


def export_serving(model: GEMModel, destination: str | os.PathLike, format: str = "exported_program") -> ServingExport:
    """Writes the serving artifact folder of `model` to `destination` (atomically)."""
    if format not in FORMATS:
        raise ValueError(f"serving format must be one of {FORMATS}, got {format!r}")
    if not model.config.use_sequence or model.config.architecture != "gem":
        raise ValueError(f"only GEM-architecture models with a history export for serving, got "
                         f"{model.config.architecture} (use_sequence={model.config.use_sequence})")
    started = time.perf_counter()
    graph = ServingGraph(model.cpu().eval())
    programs = {"default": _program(graph, history=_traced_history(model), dynamic_history=True),
                **{client.program_name(n): _program(graph, history=n, dynamic_history=False)
                   for n in SHORT_HISTORIES[format]}}
    suffix = ".aoti.pt2" if format == "aot_inductor" else ".pt2"
    with atomic_path(destination) as folder:
        folder.mkdir(parents=True)
        files = {}
        for name, program in programs.items():
            files[name] = f"{name}{suffix}"
            if format == "aot_inductor":
                torch._inductor.aoti_compile_and_package(program, package_path=str(folder / files[name]))
            else:
                torch.export.save(program, folder / files[name])
        (folder / client.MANIFEST).write_text(json.dumps(manifest(model, format, files), indent=2))
        shutil.copyfile(client.__file__, folder / "serving_client.py")
        if format == "aot_inductor":
            _check_compiled(graph, folder)
    return ServingExport(os.fspath(destination), format, time.perf_counter() - started)


def manifest(model: GEMModel, format: str, files: dict[str, str]) -> dict:
    spec, config = model.spec, model.config
    return {
        "format": format, "programs": files, "torch_version": torch.__version__,
        "inputs": [{"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": shape}
                   for name, (dtype, shape) in request_inputs(config.sequence.retrieved_events).items()],
        "outputs": [f"p_{task}" for task in model.objectives],
        "surfaces": list(spec.surfaces), "event_types": list(spec.event_types),
        "sparse_features": list(spec.sparse_features), "dense_features": list(spec.dense_features),
        "history_item_features": list(spec.history_item_features),
        "representation_dim": config.teacher_representation_dim,
        "max_history_len": config.sequence.max_history_len,
        "retrieved_events": config.sequence.retrieved_events,
        "retrieval_key": config.sequence.retrieval_key,
        "max_candidates": MAX_CANDIDATES,
    }


def example_request(model: GEMModel, candidates: int, history: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random request of the model's shapes (ids in their ranges; for a model with retrieved events, each
    candidate's retrieved events of its own item, from none to all of its slots)."""
    g = torch.Generator().manual_seed(seed)
    spec = model.spec
    ids = lambda high, *shape: torch.randint(0, high, shape, generator=g)  # noqa: E731
    request = {
        "surface": ids(len(spec.surfaces)), "user_id": ids(10**9, 1), "item_id": ids(10**6, candidates),
        "sparse_features": ids(100, candidates, len(spec.sparse_features)),
        "dense_features": torch.rand(candidates, len(spec.dense_features), generator=g) * 10,
        "history_item_id": ids(10**6, history), "history_surface": ids(len(spec.surfaces), history),
        "history_event_type": ids(len(spec.event_types), history), "history_action": ids(spec.n_actions, history),
        "history_age_seconds": torch.rand(history, generator=g) * 1e6,
        "history_item_features": ids(100, history, len(spec.history_item_features)) - 1,
        "representation": torch.randn(model.config.teacher_representation_dim, generator=g),
    }
    k = model.config.sequence.retrieved_events
    if k:
        request |= {
            "retrieved_item_id": request["item_id"].unsqueeze(1).expand(candidates, k).clone(),
            "retrieved_surface": ids(len(spec.surfaces), candidates, k),
            "retrieved_event_type": ids(len(spec.event_types), candidates, k),
            "retrieved_action": ids(spec.n_actions, candidates, k),
            "retrieved_age_seconds": torch.rand(candidates, k, generator=g) * 1e7,
            "retrieved_item_features": ids(100, candidates, k, len(spec.history_item_features)) - 1,
            "retrieved_count": ids(k + 1, candidates),
        }
    return request


def _check_compiled(graph: ServingGraph, folder: Path) -> None:
    """The compiled programs against the graph below, at and past every pyramid level's cut: AOTInductor's
    compiled code is not checked against the sizes it was traced at (see _traced_history)."""
    config = graph.model.config.sequence
    lengths = sorted({0, 1, 2, 3, *(min(config.level_tokens(b) + d, config.max_history_len)
                                    for b in range(graph.model.config.blocks) for d in (0, 1)),
                      config.max_history_len, config.max_history_len + 1})
    served = client.ServingClient(folder)
    for length in lengths:
        request = example_request(graph.model, 3, length, seed=length)
        with torch.no_grad():
            expected = graph(*(request[name] for name in _inputs(graph)))
        try:
            got = torch.stack(list(served.score(request).values()), 1)
            wrong = not torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        except RuntimeError as error:
            wrong = str(error).splitlines()[0]
        if wrong:
            raise RuntimeError(f"the aot_inductor serving artifact does not score a history of {length} events as the "
                               f"model does ({'different scores' if wrong is True else wrong}); export this model "
                               "with format exported_program")


def _traced_history(model: GEMModel) -> int:
    """The history length the dynamic program is traced at: past the longest history the model reads, so that
    every pyramid level cuts it. AOTInductor sizes buffers by decisions taken on the traced sizes without checking
    them when it runs: traced at 3 events, which every level keeps whole, it sized a later level's keys by the
    first level's length (torch 2.13), and scores went wrong, or the process failed, past the first cut."""
    return model.config.sequence.max_history_len + 3


def _program(graph: ServingGraph, history: int, dynamic_history: bool) -> torch.export.ExportedProgram:
    candidates = Dim("candidates", min=2, max=MAX_CANDIDATES)
    events = Dim("history", min=0, max=MAX_HISTORY) if dynamic_history else None
    names = _inputs(graph)
    shapes = {name: {0: candidates} if name in CANDIDATE_INPUTS else
              {0: events} if name in HISTORY_INPUTS and dynamic_history else None for name in names}
    request = example_request(graph.model, 4, history)
    # Sizes 0 and 1 are not singled out while tracing (see SHORT_HISTORIES); candidates start at 2 (the client
    # pads a single one).
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(graph, tuple(request[name] for name in names),
                                   dynamic_shapes=tuple(shapes[name] for name in names),
                                   prefer_deferred_runtime_asserts_over_guards=True)


def _inputs(graph: ServingGraph) -> list[str]:
    return list(request_inputs(graph.retrieved_events))
