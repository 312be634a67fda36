"""Serving: the exported artifact scores requests as the registered pyfunc does, loads with torch alone, and
the latency gate keeps a champion slower than the budget from serving."""

import json
import os
import subprocess
import sys

import mlflow.pyfunc
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from gem_ops.model.config import FeatureSpec, model_config
from gem_ops.serving.client import ServingClient
from gem_ops.serving.export import example_request, export_serving
from gem_ops.serving.latency import LatencySettings
from gem_ops.serving.registry import SERVING, download_serving_artifact, serve_champion
from gem_ops.serving.request import request_batch
from gem_ops.tracking import RunTracker
from gem_ops.train.mlflow_model import batch_to_frame, input_example, log_model, predict_frame
from gem_ops.train.model_state import seeded_model
from gem_ops.transfer.registry import CHAMPION, set_alias
from tests.model_inputs import SPEC

NAME = "vertical_feed_click"
REPRESENTATION = 8
MAX_HISTORY = 16
# (candidates, history length): one candidate, no history, one event, longer than the model reads, ...
SHAPES = [(1, 0), (3, 1), (5, 7), (40, MAX_HISTORY), (2, 3 * MAX_HISTORY)]


def _model(seed: int, retrieved_events: int = 0):
    config = model_config("vertical", width=0.5, teacher_representation_dim=REPRESENTATION,
                          **{"sequence.max_history_len": MAX_HISTORY, "sequence.first_level_tokens": 8,
                             "sequence.retrieved_events": retrieved_events})
    model = seeded_model(SPEC, config, seed=seed)
    with torch.no_grad():  # every weight away from its start (the representation's projection starts at zero)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _request(model, candidates: int, history: int, seed: int) -> dict[str, torch.Tensor]:
    request = example_request(model, candidates, history, seed)
    if history:  # some candidates are items of the history: the match features count
        request["item_id"][::2] = request["history_item_id"][-1]
    return request


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("serving", artifact_location=str(root / "artifacts"))
    models = [_model(seed) for seed in (0, 1)]
    for model in models:
        run = client.create_run(experiment).info.run_id
        example = batch_to_frame(request_batch(_request(model, 2, 3, 0), SPEC), SPEC)
        log_model(client, run, model, example, NAME)
    return {"root": root, "uri": uri, "client": client, "experiment": experiment, "models": models}


def test_the_exported_artifact_scores_as_the_registered_pyfunc_without_the_project_code(registry, tmp_path):
    model = registry["models"][0]
    folder = export_serving(model, tmp_path / "serving").folder
    requests = [_request(model, n, length, seed) for seed, (n, length) in enumerate(SHAPES)]
    mlflow.set_tracking_uri(registry["uri"])
    pyfunc = mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    expected = [pyfunc.predict(batch_to_frame(request_batch(r, SPEC), SPEC))["p_click"].to_numpy() for r in requests]
    # The client in a fresh interpreter, from the artifact folder alone: torch only, no project module.
    torch.save(requests, tmp_path / "requests.pt")
    script = ("import sys, torch; from serving_client import ServingClient; c = ServingClient('.'); "
              "out = [c.score(r)['p_click'] for r in torch.load(sys.argv[1])]; "
              "assert not [m for m in sys.modules if m.split('.')[0] in ('gem_ops', 'kernels', 'mlflow')], "
              "sys.modules; "
              "torch.save(out, sys.argv[2])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "requests.pt"), str(tmp_path / "scores.pt")],
                   cwd=folder, env=env, check=True)
    served = torch.load(tmp_path / "scores.pt")
    manifest = json.loads((tmp_path / "serving" / "serving.json").read_text())
    assert manifest["outputs"] == ["p_click", "p_conversion"] and manifest["representation_dim"] == REPRESENTATION
    for (n, _), got, want in zip(SHAPES, served, expected):
        assert got.shape == (n,)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_aot_inductor_serves_a_two_block_gem_as_the_model_scores_below_at_and_past_every_levels_cut(tmp_path):
    """Traced below the pyramid's cuts, AOTInductor sized the second level's keys by the first level's length:
    a history of 17 events failed with a size error. About 2 minutes of compiling on 2 cores."""
    config = model_config("gem", width=0.25, blocks=2,
                          **{"sequence.max_history_len": 64, "sequence.first_level_tokens": 16,
                             "embedding.item_buckets": 1024, "embedding.user_buckets": 1024})
    model = seeded_model(SPEC, config).eval()
    levels = [config.sequence.level_tokens(b) for b in range(config.blocks)]
    assert len(set(levels)) == 2 and max(levels) < config.sequence.max_history_len  # two cuts below the longest history
    folder = export_serving(model, tmp_path / "serving", "aot_inductor").folder
    served = ServingClient(folder)
    for length in (0, 1, 5, *(n + 1 for n in levels), 40, 64, 100):
        request = _request(model, 7, length, seed=length)
        want = predict_frame(model, batch_to_frame(request_batch(request, SPEC), SPEC))  # the pyfunc's scoring
        got = served.score(request)
        for task in model.objectives:
            np.testing.assert_allclose(got[f"p_{task}"].numpy(), want[f"p_{task}"].to_numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{length} events, {task}")


def test_a_model_with_retrieved_events_serves_them_per_candidate_as_its_pyfunc_scores_them(registry, tmp_path):
    """Each candidate's own retrieved events before the shared history: the exported artifact (dense, a mask per
    candidate) scores as the registered pyfunc (GEMModel's jagged path, with the retrieved_* columns), up to
    full slots and past the model's longest history, where retrieved events displace the oldest recent ones."""
    model = _model(0, retrieved_events=3)
    client = registry["client"]
    run = client.create_run(registry["experiment"]).info.run_id
    example = batch_to_frame(request_batch(_request(model, 2, 3, 0), SPEC), SPEC)
    assert {"retrieved_item_id", "retrieved_surface", "retrieved_item_category"} <= set(example.columns)
    version = log_model(client, run, model, example, "vertical_retrieving")
    served = ServingClient(export_serving(model, tmp_path / "serving").folder)
    manifest = served.manifest
    assert manifest["retrieved_events"] == 3 and manifest["retrieval_key"] == "item"
    assert [i["name"] for i in manifest["inputs"]][-7:] == [
        "retrieved_item_id", "retrieved_surface", "retrieved_event_type", "retrieved_action",
        "retrieved_age_seconds", "retrieved_item_features", "retrieved_count"]
    mlflow.set_tracking_uri(registry["uri"])
    pyfunc = mlflow.pyfunc.load_model(f"models:/vertical_retrieving/{version}")
    counts = set()
    for seed, (n, length) in enumerate(SHAPES):
        request = _request(model, n, length, seed)
        counts |= set(request["retrieved_count"].tolist())
        expected = pyfunc.predict(batch_to_frame(request_batch(request, SPEC), SPEC))["p_click"].to_numpy()
        np.testing.assert_allclose(served.score(request)["p_click"].numpy(), expected, rtol=1e-5, atol=1e-6)
        # The retrieved events count: the same request without them scores otherwise.
        none = dict(request, retrieved_count=torch.zeros_like(request["retrieved_count"]))
        assert (not np.allclose(served.score(none)["p_click"].numpy(), expected, rtol=1e-4)
                or not request["retrieved_count"].any())
    assert {0, 3} <= counts  # empty and full slots among the requests
    with pytest.raises(ValueError, match="retrieved_count"):
        served.score({k: v for k, v in _request(model, 2, 3, 0).items() if k != "retrieved_count"})
    frame = batch_to_frame(request_batch(_request(model, 2, 3, 0), SPEC), SPEC)
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"missing inputs \['retrieved_item_id'\]"):
        pyfunc.predict(frame.drop(columns=["retrieved_item_id"]))  # the signature's check
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['retrieved_item_id'"):
        predict_frame(model, frame.drop(columns=["retrieved_item_id"]))
    with pytest.raises(ValueError, match="trained without retrieved events"):
        predict_frame(registry["models"][0], frame)


@pytest.mark.parametrize("key", ["item", "item_category"])
def test_the_client_retrieves_from_a_users_history_what_the_training_data_gave_the_model(tmp_path, key):
    """ServingClient.retrieve on the request of a user's whole history gives each candidate the events
    SequenceLogs.batch gave it in training: the history cap's recent events, the older ones that match it (on its
    item, or on its category) first."""
    import polars as pl

    from gem_ops.serving.client import retrieval_columns, retrieve
    from gem_ops.serving.request import request_of_example
    from tests.event_log_builders import build, example_by_item, hand_events

    views = [(9, 0, 10 * i, item, "feed", "organic_view", None, None)
             for i, item in enumerate([1, 2, 3, 1, 4, 5, 1, 6])]
    ads = [(9, 1, 0, 1, "feed", "ad_impression", 1, 0), (9, 1, 10, 8, "feed", "ad_impression", 0, 0),
           (9, 1, 20, 6, "feed", "ad_impression", 0, 0)]
    events = hand_events(views + ads).with_columns(item_category=pl.col("item_id") % 3)
    logs = build(events, tmp_path / "seq", max_history_len=64)[1]
    spec = FeatureSpec.from_logs(logs)
    columns = retrieval_columns(key, list(spec.history_item_features), list(spec.sparse_features))
    rows = np.array([example_by_item(logs, item) for item in (1, 8, 6)])
    whole = logs.batch(rows)
    if key == "item_category":  # item 8's category, 2: items 2 and 5 among the events before its 2 most recent
        found = logs.batch(rows[1:2], 64, np.array([2]), retrieved_events=5, retrieval_key=key)
        assert found.history_item_id[: int(found.retrieved_lengths[0])].tolist() == [2, 5]
    for limit, cap, k in [(64, 2, 1), (64, 2, 5), (4, 3, 2), (4, None, 5), (1, None, 5), (64, 0, 2)]:
        caps = None if cap is None else np.full(rows.size, cap)
        trained = logs.batch(rows, limit, caps, retrieved_events=k, retrieval_key=key)
        for i in range(rows.size):
            served = request_batch(retrieve(request_of_example(whole, i), min(k, limit), limit, cap, columns), spec)
            if served.history_lengths[0] > limit:  # the model's cut (predict_frame's, the graph's mask)
                from gem_ops.train.mlflow_model import _cut_histories
                served = _cut_histories(served, limit)
            a, b = (int(trained.history_offsets[i]), int(trained.history_offsets[i + 1]))
            for name in ("history_item_id", "history_action", "history_age_seconds", "history_surface"):
                assert getattr(served, name).tolist() == getattr(trained, name)[a:b].tolist(), (limit, cap, k, i, name)
            assert served.retrieved_lengths.tolist() == trained.retrieved_lengths[i : i + 1].tolist()
    if key != "item":
        return
    # The example a logged model carries reads as the model trains: its retrieved events in retrieved_* columns.
    model = seeded_model(spec, model_config("vertical", width=0.5, **{"sequence.max_history_len": 4,
                                                                      "sequence.first_level_tokens": 4,
                                                                      "sequence.retrieved_events": 2}))
    example = input_example(logs, rows, model)
    assert example["retrieved_item_id"].map(list).tolist() == [[1, 1], [], []]  # 6 is among the 4 recent events
    assert example["history_item_id"].map(len).tolist() == [2, 4, 4]  # within 4 with the retrieved ones
    assert predict_frame(model, example)["p_click"].between(0, 1).all()


def test_a_retrieval_key_the_data_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sequence.retrieval_key 'item_colour'.*\['item', 'item_category'\]"):
        seeded_model(SPEC, model_config("vertical", **{"sequence.retrieved_events": 2,
                                                             "sequence.retrieval_key": "item_colour"}))
    model = seeded_model(SPEC, model_config("vertical", **{"sequence.retrieved_events": 2,
                                                                 "sequence.retrieval_key": "item_category"}))
    assert model.config.sequence.retrieval_key == "item_category"


def test_the_latency_gate_refuses_a_champion_slower_than_the_budget(registry, tmp_path):
    client = registry["client"]
    latency = LatencySettings(candidate_counts=(1, 100), requests=5, warmup=1)

    def serve(budget):
        run = client.create_run(registry["experiment"]).info.run_id
        decision = serve_champion(client, NAME, RunTracker(client, run), budget, latency=latency)
        client.set_terminated(run)
        return decision

    set_alias(client, NAME, SERVING, "1")  # version 1 serves
    set_alias(client, NAME, CHAMPION, "2")
    decision = serve(budget=1e-3)  # a millisecond's thousandth: below any real p99
    measured = decision.latency["100"]["p99_ms"]
    # Real timings, measured per shape (their order is left to benchmarks: a busy machine's spike can invert it)
    assert 0 < decision.latency["1"]["p50_ms"] != measured > 0
    assert not decision.served
    assert f"p99 {measured:.2f} ms at 100 candidates exceeds the budget latency_budget_ms=0.001" in decision.reason
    assert "version 1 keeps serving" in decision.reason
    assert str(client.get_model_version_by_alias(NAME, SERVING).version) == "1"  # the previous one still serves
    tags = client.get_model_version(NAME, "2").tags
    assert (tags["serving.decision"] == "refused"
            and float(tags["serving.p99_ms_100"]) == pytest.approx(measured, abs=1e-3))
    # Within the budget it serves, and its artifact can be fetched and called.
    assert serve(budget=60_000.0).served
    assert str(client.get_model_version_by_alias(NAME, SERVING).version) == "2"
    folder = download_serving_artifact(client, NAME, str(tmp_path))
    assert json.loads(open(os.path.join(folder, "serving.json")).read())["format"] == "exported_program"


def test_the_bucketed_policy_spends_history_where_held_out_loss_falls_and_never_loses_to_a_fixed_cap():
    from gem_ops.serving.adaptive import BucketedHistoryPolicy, fit_bucketed_policy, history_costs, request_costs

    config = model_config("gem", width=0.5, blocks=2,
                          **{"sequence.max_history_len": 1024, "sequence.first_level_tokens": 32})
    costs = history_costs(config, SPEC)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(4.0, 1.5, 4000).astype(int), 5000)
    held_lengths = np.minimum(rng.lognormal(4.0, 1.5, 3000).astype(int), 5000)
    edges = (32, 128, 512, 2048)
    menu = (16, 64, 256, 1024)
    # Users with 128-512 events gain from every further event they show; the others stop gaining at 16.
    middle = (held_lengths >= 128) & (held_lengths < 512)
    losses = {cap: 0.5 - np.where(middle, 0.02 * np.log2(cap / 16), 0.0) for cap in menu}
    for fixed in (64, 256):
        budget = request_costs(costs, lengths, fixed).mean()
        policy = fit_bucketed_policy(held_lengths, losses, lengths, costs, budget, edges, monotone=False)
        spent = request_costs(costs, lengths, policy.caps(lengths))
        assert spent.mean() <= budget and spent.max() <= costs[max(menu)]
        # The band that gains keeps at least the fixed cap; the others get the shortest cap, which loses nothing.
        assert policy.bucket_caps[2] >= fixed and set(policy.bucket_caps) - {policy.bucket_caps[2]} == {16}, policy
        def expected(chosen):
            return np.mean([losses[cap][i] for i, cap in enumerate(chosen.caps(held_lengths))])
        for cap in menu:  # on the held-out requests, no fixed cap within the budget does better
            if request_costs(costs, lengths, cap).mean() <= budget:
                assert expected(policy) <= expected(BucketedHistoryPolicy(edges, (cap,) * 5)) + 1e-3
    # Half of what 1024 for everyone costs: the budget goes to the band that gains, in full.
    half = request_costs(costs, lengths, 1024).mean() / 2
    assert fit_bucketed_policy(held_lengths, losses, lengths, costs, half, edges, monotone=False).bucket_caps == (
        16, 16, 1024, 16, 16)
    # Monotone (the default): no longer history gets a shorter cap, and the budget still holds.
    monotone = fit_bucketed_policy(held_lengths, losses, lengths, costs, half, edges)
    assert list(monotone.bucket_caps) == sorted(monotone.bucket_caps) and monotone.bucket_caps[:2] == (16, 16)
    assert request_costs(costs, lengths, monotone.caps(lengths)).mean() <= half
    with pytest.raises(ValueError, match="below the mean cost of the shortest cap"):
        fit_bucketed_policy(held_lengths, losses, lengths, costs, request_costs(costs, lengths, 8).mean(), edges)
    with pytest.raises(ValueError, match="one cap per bucket"):
        BucketedHistoryPolicy((32, 16), (16, 64, 256))


def test_retrieved_history_costs_what_its_lookup_finds_and_is_judged_against_a_cap_of_at_least_its_cost():
    from gem_ops.serving.adaptive import fixed_cap_of_cost, history_costs, request_costs, retrieval_costs

    config = model_config("gem", width=0.5, blocks=2,
                          **{"sequence.max_history_len": 1024, "sequence.first_level_tokens": 32})
    costs = history_costs(config, SPEC)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.5, 1.5, 5000).astype(int), 3000)
    found = np.where(rng.random(5000) < 0.3, rng.integers(1, 9, 5000), 0)  # up to 8 retrieved, for 30% of them
    for cap in (16, 64, 256):
        spent = retrieval_costs(costs, lengths, cap, found)
        plain = request_costs(costs, lengths, cap)
        assert np.all(spent[found == 0] == plain[found == 0]) and np.all(spent[found > 0] > plain[found > 0])
        assert spent.max() <= costs[cap + 8]  # the bound a request's compute budget holds
        equal = fixed_cap_of_cost(costs, lengths, spent.mean())
        assert request_costs(costs, lengths, equal).mean() >= spent.mean()
        assert request_costs(costs, lengths, equal - 1).mean() < spent.mean()  # the shortest such cap
    assert retrieval_costs(costs, np.array([1020]), 1024, np.array([8]))[0] == costs[1024]  # the model's bound
    with pytest.raises(ValueError, match="no fixed cap"):
        fixed_cap_of_cost(costs, lengths, costs[1024] * 2)


def test_the_adaptive_policy_spends_the_long_cap_on_long_histories_within_its_mean_budget():
    from gem_ops.serving.adaptive import fit_policy, history_costs, request_costs

    config = model_config("gem", width=0.5, blocks=2,
                          **{"sequence.max_history_len": 1024, "sequence.first_level_tokens": 32})
    costs = history_costs(config, SPEC)
    assert np.all(np.diff(costs) > 0)  # every further event costs something
    lengths = np.minimum(np.random.default_rng(0).lognormal(3.5, 1.5, 5000).astype(int), 3000)
    thresholds = []
    for fixed in (16, 64, 256):
        budget = request_costs(costs, lengths, fixed).mean()  # what the fixed cap spends on average
        policy = fit_policy(lengths, costs, budget, short_cap=16, long_caps=1024)
        spent = request_costs(costs, lengths, policy.caps(lengths))
        assert spent.mean() <= budget and spent.max() <= costs[1024]
        long_users = lengths >= policy.threshold
        assert np.all(policy.caps(lengths)[long_users] == 1024) and np.all(policy.caps(lengths)[~long_users] == 16)
        # The lowest such threshold: from the next shorter user on, the budget is exceeded.
        lower = type(policy)(16, 1024, int(lengths[lengths < policy.threshold].max()))
        assert request_costs(costs, lengths, lower.caps(lengths)).mean() > budget
        thresholds.append(policy.threshold)
    assert thresholds[0] > thresholds[1] > thresholds[2]  # more budget, more users on the long cap
    # Histories that all reach the model's maximum tie: a budget too small to give 1024 to all of them gives 256.
    tied = np.concatenate([np.full(100, 1024), np.full(900, 8)])
    budget = request_costs(costs, tied, 300).mean()
    policy = fit_policy(tied, costs, budget, short_cap=16, long_caps=(1024, 256))
    assert policy.long_cap == 256 and np.all(policy.caps(tied)[:100] == 256)
    assert request_costs(costs, tied, policy.caps(tied)).mean() <= budget
    with pytest.raises(ValueError, match="mean_budget .* below the mean cost of the short cap"):
        fit_policy(lengths, costs, request_costs(costs, lengths, 8).mean(), short_cap=16, long_caps=1024)


def test_the_match_reach_policy_reads_down_to_a_far_match_within_its_mean_budget():
    from gem_ops.serving.adaptive import MatchReachPolicy, fit_match_policy, history_costs, request_costs

    config = model_config("gem", width=0.5, blocks=2,
                          **{"sequence.max_history_len": 1024, "sequence.first_level_tokens": 32})
    costs = history_costs(config, SPEC)
    rng = np.random.default_rng(0)

    def requests(n):  # one in ten candidates was met before, anywhere in the user's history
        lengths = np.minimum(rng.lognormal(5.0, 1.2, n).astype(int), 5000)
        met = rng.random(n) < 0.1
        return lengths, np.where(met, rng.integers(1, np.maximum(lengths, 1) + 1), 0)

    lengths, depths = requests(4000)
    held_depths = requests(3000)[1]
    menu = (16, 64, 256, 1024)
    # A request gains only when its history reaches its match (and 64 events help everyone a little).
    losses = {cap: 0.5 - 0.05 * ((held_depths > 0) & (held_depths <= cap)) - 0.01 * (cap >= 64) for cap in menu}
    expected = lambda caps: np.mean([losses[c][i] for i, c in enumerate(caps)])  # noqa: E731
    for fixed in (64, 256):
        budget = request_costs(costs, lengths, fixed).mean()
        policy = fit_match_policy(held_depths, losses, lengths, depths, costs, budget)
        caps = policy.caps(lengths, depths)
        assert request_costs(costs, lengths, caps).mean() <= budget
        reached = (depths > policy.base_cap) & (depths <= policy.reach_depth)
        assert np.all(caps[~reached] == policy.base_cap) and np.all(caps[reached] >= depths[reached])
        # the shortest that reaches
        assert np.all(caps[reached] == np.asarray(menu)[np.searchsorted(menu, depths[reached])])
        # Every deeper reach would break the budget, and the fitted policy beats the fixed cap on held-out loss.
        deeper = depths[(depths > policy.reach_depth) & (depths <= max(menu))]
        if deeper.size:
            wider = MatchReachPolicy(policy.base_cap, menu, int(deeper.min()))
            assert request_costs(costs, lengths, wider.caps(lengths, depths)).mean() > budget
        gain = expected(np.full(held_depths.size, fixed)) - expected(policy.caps(None, held_depths))
        # at 256: base 64, its savings reach deeper matches
        assert gain >= 0 and (fixed == 64 or gain > 0), (policy, gain)
    with pytest.raises(ValueError, match="below the mean cost of the shortest cap"):
        fit_match_policy(held_depths, losses, lengths, depths, costs, request_costs(costs, lengths, 8).mean())
    with pytest.raises(ValueError, match="increasing reach_caps"):
        MatchReachPolicy(64, (256, 16), 256)


def test_the_latency_warm_up_scores_every_length_and_candidate_count_once():
    from gem_ops.serving.latency import warm_up_latency

    seen = []
    warm_up_latency(lambda request: seen.append((request["n"], request["length"])),
                    lambda n, length: {"n": n, "length": length}, [0, 16, 32], (1, 100))
    assert seen == [(1, 0), (100, 0), (1, 16), (100, 16), (1, 32), (100, 32)]


def test_scorers_measured_side_by_side_take_turns_on_their_own_requests():
    from gem_ops.serving.latency import LatencySettings, measure_side_by_side

    calls = []
    scorers = {name: (lambda request, name=name: calls.append((name, request["n"], request["seed"])),
                      lambda n, seed, name=name: {"n": n, "seed": seed, "for": name}) for name in ("a", "b", "c")}
    figures = measure_side_by_side(scorers, LatencySettings((1, 100), requests=4, warmup=1))
    assert set(figures) == {"a", "b", "c"} and all(set(f) == {1, 100} and f[1]["requests"] == 4
                                                   for f in figures.values())
    timed = [call for call in calls if call[2] >= 1 and call[1] == 1]  # seed 0 is each one's warm-up
    assert timed == [("a", 1, 1), ("b", 1, 1), ("c", 1, 1), ("b", 1, 2), ("c", 1, 2), ("a", 1, 2),
                     ("c", 1, 3), ("a", 1, 3), ("b", 1, 3), ("a", 1, 4), ("b", 1, 4), ("c", 1, 4)]


def test_the_serving_graphs_self_attention_masks_have_four_dims_so_the_cpus_fused_kernel_runs(monkeypatch):
    """With a 3-D mask the CPU's scaled_dot_product_attention takes its math path, not its fused kernel."""
    from torch.nn import functional as F

    from gem_ops.serving import graph

    sdpa, masks = F.scaled_dot_product_attention, []

    def recording(q, k, v, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    n, lq, lk, heads, dim = 3, 5, 9, 2, 4
    q, k, v = (torch.randn(n, length, heads, dim) for length in (lq, lk, lk))
    shared, per_candidate = torch.rand(lk) > 0.3, torch.rand(n, lk) > 0.3
    shared[0] = per_candidate[:, 0] = True  # the summary key every query sees
    for mask in (shared, per_candidate):
        got = graph._attention(q, k, v, mask, "softmax", summary_keys=True)
        scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * dim**-0.5
        scores = scores.masked_fill(~mask.expand(n, lk)[:, None, None, :], float("-inf"))
        want = torch.einsum("nhqk,nkhd->nqhd", scores.softmax(-1), v)
        torch.testing.assert_close(got, want)
    assert [m.dim() for m in masks] == [4, 4]
